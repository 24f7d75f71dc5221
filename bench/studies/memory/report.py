"""The memory study's Markdown report: our figures beside the vLLM paper's anchors (Kwon et al., 2023).

Everything here is rendered from the JSON document :func:`bench.studies.memory.study.run_study` returns; no
figure is written by hand except the paper's, which are data below (``PAPER``).
"""

from __future__ import annotations

from pagedbench.bench.common.environment import environment_markdown
from tabulate import tabulate

#: The vLLM paper's figures (see /work/shared/ANCHORS.md); shares in percent.
PAPER = {
    # Figure 18b: best block sizes
    "best_block_sizes": {"sharegpt": "16-128", "alpaca": "16-32"},
    # Figure 15: memory saved by sharing, parallel sampling on Alpaca, n -> percent
    "fig15": {2: 6.09, 4: 8.53, 6: 9.79},
}
POLICIES = ("max", "pow2", "oracle")
BEST_TOLERANCE = 0.05  # "best" block sizes: mean normalized latency within 5% of the lowest


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def find_run(runs: list[dict], *, workload: str, kind: str, policy: str | None = None,
             block_size: int | None = None, placement: str = "buddy") -> dict | None:
    for r in runs:
        a = r["allocator"]
        if r["workload"]["name"] != workload or a["kind"] != kind:
            continue
        if kind == "orca" and (a["policy"] != policy or a["placement"] != placement):
            continue
        if kind == "paged" and a["block_size"] != block_size:
            continue
        return r
    return None


def best_block_sizes(doc: dict, workload: str) -> list[int]:
    """Block sizes whose mean normalized latency is within BEST_TOLERANCE of the lowest."""
    lat = {}
    for bs in doc["config"]["block_sizes"]:
        r = find_run(doc["runs"], workload=workload, kind="paged", block_size=bs)
        if r is not None and r["mean_normalized_latency_s"] is not None:
            lat[bs] = r["mean_normalized_latency_s"]
    return [b for b, v in lat.items() if v <= (1 + BEST_TOLERANCE) * min(lat.values())] if lat else []


def block_size_tables(doc: dict) -> str:
    cfg, runs, out = doc["config"], doc["runs"], []
    for w in cfg["workloads"]:
        rows = []
        for bs in cfg["block_sizes"]:
            r = find_run(runs, workload=w["name"], kind="paged", block_size=bs)
            if r is None:
                continue
            s = r["shares"]
            rows.append([bs, _pct(s["token_states"]), _pct(s["reserved"]), _pct(s["internal_fragmentation"]),
                         _pct(s["free"]), _num(r["mean_running"]), r["peak_running"], r["num_preemptions"],
                         _num(r["mean_normalized_latency_s"], ".3f")])
        best = ", ".join(map(str, best_block_sizes(doc, w["name"]))) or "–"
        paper = PAPER["best_block_sizes"].get(w["dataset"] or "", "–")
        head = ["block size", "token %", "reserved %", "internal %", "free %", "mean running", "peak",
                "preemptions", "norm. latency s/token"]
        which = "every request" if cfg.get("drain", True) else "the requests finished in the window"
        out.append(f"**{w['name']}**. Best block sizes (mean normalized "
                   f"latency of {which} within {BEST_TOLERANCE:.0%} of the lowest), ours: {best}; "
                   f"paper: {paper}.\n\n"
                   + tabulate(rows, head, tablefmt="github") + "\n")
    return "\n".join(out)


def placement_table(doc: dict) -> str:
    cfg, rows = doc["config"], []
    for w in cfg["workloads"]:
        for p in POLICIES:
            cells = []
            for pl in cfg["orca_placements"]:
                r = find_run(doc["runs"], workload=w["name"], kind="orca", policy=p, placement=pl)
                s = r and r["shares"]
                cells += [_pct(s and s["token_states"]), _pct(s and s["external_fragmentation"]),
                          _num(r and r["mean_running"])]
            rows.append([w["name"], p, *cells])
    head = ["workload", "policy"] + [f"{pl}: {c}" for pl in cfg["orca_placements"]
                                     for c in ("token %", "external %", "mean running")]
    return tabulate(rows, head, tablefmt="github") + "\n"


def sharing_table(doc: dict) -> str:
    rows = [[s["n"], s["block_size"], _pct(s["saving"]), _num(PAPER["fig15"].get(s["n"]), ".2f")]
            for s in doc["sharing"]]
    ds = doc["sharing"][0]["dataset"] if doc["sharing"] else "?"
    return (f"Parallel sampling on {ds}: 1 - blocks used with BlockManager.fork / blocks of n independent "
            "copies, summed over every step (no memory pressure).\n\n"
            + tabulate(rows, ["n", "block size", "saved % (ours)", "paper %"], tablefmt="github") + "\n")


def markdown(doc: dict) -> str:
    invalid = [f"- {r['workload']['name']} / {r['allocator']['name']}: "
               + "; ".join(r["validity"]["reasons"]) for r in doc["runs"] if not r["validity"]["valid"]]
    cfg = doc["config"]
    parts = [
        "# Memory-waste study\n",
        f"KV budget {cfg['kv_slots']} token slots, max sequence length {cfg['max_seq_len']}, "
        f"step times from the cost model of {cfg['model']} on {cfg['hardware']}, {len(doc['runs'])} simulations. "
        "Generated by `python -m pagedbench.bench` (bench/studies/memory/study.py) from results/memory.json. "
        "The shares of KV memory (Figure 2) and the mean batch (Figure 13) are the serving study's "
        "([serving.md](serving.md)), from its span runs.\n",
        "## Block-size sweep (paged; Figure 18b)\n", block_size_tables(doc),
        "![block sizes](memory_block_size.png)\n",
        "## Orca placement: buddy vs first fit\n", placement_table(doc),
        "## Memory saved by sharing (Figure 15)\n", sharing_table(doc),
        "## Validity\n", ("\n".join(invalid) + "\n") if invalid else "Every run valid.\n",
        "## Environment\n", environment_markdown(doc["environment"]),
    ]
    return "\n".join(parts)
