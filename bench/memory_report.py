"""The memory study's Markdown report: our figures beside the vLLM paper's anchors (Kwon et al., 2023).

Everything here is rendered from the JSON document :func:`bench.memory_study.run_study` returns; no
figure is written by hand except the paper's, which are data below (``PAPER``).
"""

from __future__ import annotations

from pagedbench.bench.environment import environment_markdown
from tabulate import tabulate

#: The vLLM paper's figures (see /work/shared/ANCHORS.md); shares in percent.
PAPER = {
    # Figure 2: token states / reservation / internal fragmentation / external fragmentation & others
    "fig2": {"max": (20.4, 13.3, 57.3, 8.9), "pow2": (26.8, 17.9, 13.6, 41.6),
             "oracle": (38.2, 25.2, None, 36.6), "vllm": (96.3, None, None, None)},
    # Figure 13: mean batched requests, (dataset, rate) -> Max / Pow2 / Oracle / vLLM
    "fig13": {("sharegpt", 2.0): (7.00, 9.81, 13.62, 30.42), ("alpaca", 30.0): (7.00, 43.24, 72.75, 132.44)},
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


def find_run(runs: list[dict], *, workload: str, step_s: float, kind: str, policy: str | None = None,
          block_size: int | None = None, placement: str = "buddy") -> dict | None:
    for r in runs:
        a = r["allocator"]
        if r["workload"]["name"] != workload or r["step_s"] != step_s or a["kind"] != kind:
            continue
        if kind == "orca" and (a["policy"] != policy or a["placement"] != placement):
            continue
        if kind == "paged" and a["block_size"] != block_size:
            continue
        return r
    return None


def _anchored(doc: dict, dataset: str, rate: float) -> str | None:
    for w in doc["config"]["workloads"]:
        if w["dataset"] == dataset and w["rate"] == rate and w["trace"] is None:
            return w["name"]
    return None


def baselines(doc: dict, workload: str, step_s: float) -> list[tuple[str, dict | None]]:
    runs, bs = doc["runs"], doc["config"]["vllm_block_size"]
    rows = [(p, find_run(runs, workload=workload, step_s=step_s, kind="orca", policy=p)) for p in POLICIES]
    return [*rows, ("vllm", find_run(runs, workload=workload, step_s=step_s, kind="paged", block_size=bs))]


def figure2_table(doc: dict) -> str:
    workload = _anchored(doc, "sharegpt", 2.0)
    if workload is None:
        return "(no ShareGPT @ 2 req/s workload in this config)\n"
    step = doc["config"]["step_s"]
    rows = []
    for key, r in baselines(doc, workload, step):
        paper = PAPER["fig2"][key]
        s = r["shares"] if r else None
        over = s and s["internal_fragmentation"] - s["rounding_waste"]
        others = s and s["rounding_waste"] + s["external_fragmentation"] + s["free"]
        name = r["allocator"]["name"] if r else key
        rows.append([name + (" = vLLM" if key == "vllm" else ""),
                     _pct(s and s["token_states"]), _num(paper[0], ".1f"),
                     _pct(s and s["reserved"]), _num(paper[1], ".1f"),
                     _pct(over), _num(paper[2], ".1f"),
                     _pct(s and s["rounding_waste"]), _pct(s and s["external_fragmentation"]),
                     _pct(s and s["free"]), _pct(others), _num(paper[3], ".1f")])
    head = ["allocator", "token states", "paper", "reserved", "paper", "internal (over-reservation)", "paper",
            "buddy rounding", "external frag.", "free", "rounding + external + free", "paper: ext. & others"]
    return (f"Workload {workload}, step {step} s. Shares of the KV pool in %, time-averaged. The paper's "
            "internal fragmentation is over-reservation only (its Oracle has none); we map its "
            "\"external fragmentation & others\" to our buddy rounding + external fragmentation + free.\n\n"
            + tabulate(rows, head, tablefmt="github") + "\n")


def figure13_table(doc: dict) -> str:
    rows = []
    for (dataset, rate), paper in PAPER["fig13"].items():
        workload = _anchored(doc, dataset, rate)
        if workload is None:
            continue
        for step in sorted({doc["config"]["step_s"], *doc["config"]["step_sweep_s"]}):
            ours = [r and r["mean_running"] for _, r in baselines(doc, workload, step)]
            rows.append([workload, step, *(f"{_num(o)} ({_num(p)})" for o, p in zip(ours, paper))])
    head = ["workload", "step s", "Orca Max", "Orca Pow2", "Orca Oracle", "vLLM (paged bs=16)"]
    return ("Mean requests running at once, ours (paper's Figure 13 in parentheses), at every step time.\n\n"
            + tabulate(rows, head, tablefmt="github") + "\n")


def best_block_sizes(doc: dict, workload: str, step_s: float) -> list[int]:
    """Block sizes whose mean normalized latency is within BEST_TOLERANCE of the lowest."""
    lat = {}
    for bs in doc["config"]["block_sizes"]:
        r = find_run(doc["runs"], workload=workload, step_s=step_s, kind="paged", block_size=bs)
        if r is not None and r["mean_normalized_latency_s"] is not None:
            lat[bs] = r["mean_normalized_latency_s"]
    return [b for b, v in lat.items() if v <= (1 + BEST_TOLERANCE) * min(lat.values())] if lat else []


def block_size_tables(doc: dict) -> str:
    cfg, runs, out = doc["config"], doc["runs"], []
    steps = sorted({cfg["step_s"], *cfg["step_sweep_s"]})
    for w in cfg["workloads"]:
        rows = []
        for bs in cfg["block_sizes"]:
            r = find_run(runs, workload=w["name"], step_s=cfg["step_s"], kind="paged", block_size=bs)
            if r is None:
                continue
            s = r["shares"]
            rows.append([bs, _pct(s["token_states"]), _pct(s["reserved"]), _pct(s["internal_fragmentation"]),
                         _pct(s["free"]), _num(r["mean_running"]), r["peak_running"], r["num_preemptions"],
                         _num(r["mean_normalized_latency_s"], ".3f")])
        by_step = "; ".join(f"step {s} s: {', '.join(map(str, best_block_sizes(doc, w['name'], s))) or '–'}"
                            for s in steps)
        paper = PAPER["best_block_sizes"].get(w["dataset"] or "", "–")
        head = ["block size", "token %", "reserved %", "internal %", "free %", "mean running", "peak",
                "preemptions", "norm. latency s/token"]
        which = "every request" if cfg.get("drain", True) else "the requests finished in the window"
        out.append(f"**{w['name']}** (table at step {cfg['step_s']} s). Best block sizes (mean normalized "
                   f"latency of {which} within {BEST_TOLERANCE:.0%} of the lowest), ours: {by_step}; "
                   f"paper: {paper}.\n\n"
                   + tabulate(rows, head, tablefmt="github") + "\n")
    return "\n".join(out)


def step_table(doc: dict) -> str:
    cfg, rows = doc["config"], []
    steps = sorted({cfg["step_s"], *cfg["step_sweep_s"]})
    for w in cfg["workloads"]:
        for key in (*POLICIES, "vllm"):
            cells = []
            for step in steps:
                r = dict(baselines(doc, w["name"], step))[key]
                cells.append("–" if r is None else
                             f"{_pct(r['shares']['token_states'])}% / {_num(r['mean_running'], '.1f')}")
            name = "paged bs=16" if key == "vllm" else f"Orca ({key.capitalize()})"
            rows.append([w["name"], name, *cells])
    return ("Token-state share / mean running requests as the step time moves. Orca is capped by its "
            "reservations whatever the step; paged serving is memory-bound only once the offered load "
            "(rate x output length x step) exceeds what the pool holds.\n\n"
            + tabulate(rows, ["workload", "allocator", *(f"step {s} s" for s in steps)], tablefmt="github")
            + "\n")


def placement_table(doc: dict) -> str:
    cfg, rows = doc["config"], []
    for w in cfg["workloads"]:
        for p in POLICIES:
            cells = []
            for pl in cfg["orca_placements"]:
                r = find_run(doc["runs"], workload=w["name"], step_s=cfg["step_s"], kind="orca", policy=p,
                          placement=pl)
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
    invalid = [f"- {r['workload']['name']} / {r['allocator']['name']} / step {r['step_s']}: "
               + "; ".join(r["validity"]["reasons"]) for r in doc["runs"] if not r["validity"]["valid"]]
    cfg = doc["config"]
    parts = [
        "# Memory-waste study\n",
        f"KV budget {cfg['kv_slots']} token slots, max sequence length {cfg['max_seq_len']}, "
        f"main step {cfg['step_s']} s, {len(doc['runs'])} simulations. Generated by `python -m pagedbench.bench` "
        "(bench/memory_study.py) from results/memory.json.\n",
        "## Share of KV memory (vLLM paper, Figure 2)\n", figure2_table(doc),
        "## Mean batched requests (Figure 13) and the step time\n", figure13_table(doc), step_table(doc),
        "## Block-size sweep (paged)\n", block_size_tables(doc),
        "## Orca placement: buddy vs first fit\n", placement_table(doc),
        "## Memory saved by sharing (Figure 15)\n", sharing_table(doc),
        "## Validity\n", ("\n".join(invalid) + "\n") if invalid else "Every run valid.\n",
        "## Environment\n", environment_markdown(doc["environment"]),
    ]
    return "\n".join(parts)
