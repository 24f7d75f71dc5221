"""Tables and plots of the serving study (``results/serving.{md,png}``), rendered from its record."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pagedbench.bench import records
from pagedbench.bench.environment import environment_markdown
from tabulate import tabulate

#: the vLLM paper, Fig. 12 / §6.2 (ShareGPT): request rate sustained by vLLM over each Orca variant
PAPER_RATIOS = {("sharegpt", "Orca (Oracle)"): "1.7–2.7×", ("sharegpt", "Orca (Max)"): "2.7–8×",
                ("alpaca", "Orca (Oracle)"): "smaller than on ShareGPT", ("alpaca", "Orca (Max)"): "–"}
#: Fig. 2 (token-state share of KV memory) and Fig. 13 (mean batched requests), OPT-13B on an A100-40GB
PAPER_TOKEN_SHARE = {"Orca (Max)": 0.204, "Orca (Pow2)": 0.268, "Orca (Oracle)": 0.382, "paged bs=16": 0.963}
PAPER_BATCH = {("sharegpt", "Orca (Max)"): 7.00, ("sharegpt", "Orca (Pow2)"): 9.81,
               ("sharegpt", "Orca (Oracle)"): 13.62, ("sharegpt", "paged bs=16"): 30.42,
               ("alpaca", "Orca (Max)"): 7.00, ("alpaca", "Orca (Pow2)"): 43.24,
               ("alpaca", "Orca (Oracle)"): 72.75, ("alpaca", "paged bs=16"): 132.44}
PAGED = "paged bs=16"

ASSUMPTIONS = """\
- Step times come from a roofline of the model on the GPU (weights and KV bytes over achievable HBM
  bandwidth against FLOPs over achievable peak, plus fixed per-layer and per-step overheads). The
  achievable fractions and per-layer overhead were fitted on Vidur's A100 linear-layer profiles
  (Llama-2-7B/70B); attention rests on datasheet roofs at those fractions (no attention profile was
  available). The per-step overhead (2 ms) is an assumption. See `results/costmodel/` for the fit's errors.
- KV slots derive from GPU memory: `gpu_memory_utilization` x memory - weights - an activation estimate,
  over the KV bytes per token (derivation below).
- Traces are synthetic, log-normal lengths with the paper's means, Poisson arrivals; each point serves a
  fixed number of requests rather than an hour of arrivals (the paper's), so the latency knee is the same
  but the latency above it grows less.
- The scheduler is ours (refengine): FCFS, recompute preemption, watermark on the paged pool. The Orca
  baselines reserve max / prompt + pow2(output) / prompt + output slots on a buddy arena, as the paper's.
- Prices per GPU-hour are user-editable assumptions in `bench/configs/hardware/*.yaml`.
- `longctx` (prompts of about 4K-32K tokens, log-normal around 12K; outputs around 256) and the shared
  system prompt workloads (every ShareGPT-like prompt starts with the same system prompt) are our own
  shapes, not the paper's."""


def _by(rows, *keys):
    out = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def capacity_table(doc: dict) -> str:
    thresholds = [str(t) for t in doc["config"]["thresholds"]]
    rows = []
    for (setting, dataset, policy), group in _by(doc["searches"], "setting", "dataset", "policy").items():
        by_alloc = _by(group, "allocator")
        paged = [r for (name,), runs in by_alloc.items() if name.startswith("paged") for r in runs]
        for (alloc,), runs in sorted(by_alloc.items()):
            caps = [("≥" if any(t in r.get("lower_bound_only", ()) for r in runs) else "")
                    + f"{sum(r['capacity'][t] for r in runs) / len(runs):.3g}" for t in thresholds]
            ratios = []
            for t in thresholds:
                ours = sum(r["capacity"][t] for r in paged) / len(paged) if paged else None
                theirs = sum(r["capacity"][t] for r in runs) / len(runs)
                ratios.append(f"{ours / theirs:.2f}×" if ours and theirs else "–")
            paper = PAPER_RATIOS.get((dataset, alloc), "–") if not alloc.startswith("paged") else ""
            rows.append([setting, dataset, policy, alloc, *caps, *ratios, paper])
    headers = ["setting", "dataset", "policy", "KV manager",
               *[f"capacity @{t}× (req/s)" for t in thresholds], *[f"paged / this @{t}×" for t in thresholds],
               "paper (paged / this)"]
    return tabulate(rows, headers=headers, tablefmt="github")


def memory_table(doc: dict) -> str:
    rows = []
    for m in doc["memory"]:
        sh = m["shares"]
        rows.append([m["setting"], f"{m['dataset']} @{m['rate']:g}", m["allocator"],
                     f"{100 * sh['token_states']:.1f}%", f"{100 * PAPER_TOKEN_SHARE[m['allocator']]:.1f}%"
                     if m["allocator"] in PAPER_TOKEN_SHARE else "–",
                     f"{100 * sh['reserved']:.1f}%", f"{100 * sh['internal_fragmentation']:.1f}%",
                     f"{100 * sh['external_fragmentation']:.1f}%", f"{m['mean_running']:.2f}",
                     PAPER_BATCH.get((m["dataset"], m["allocator"]), "–"), m["num_preemptions"]])
    return tabulate(rows, headers=["setting", "workload", "KV manager", "token states", "paper (Fig. 2)", "reserved",
                                   "internal frag.", "external frag.", "mean batch", "paper (Fig. 13)",
                                   "preemptions"], tablefmt="github")


def cost_table(doc: dict) -> str:
    threshold = str(doc["config"]["thresholds"][0])
    rows = []
    for s in doc["searches"]:
        cap = s["capacity"][threshold]
        at = [p for p in s["points"] if p["rate"] <= cap] or s["points"][:1]
        point = max(at, key=lambda p: p["rate"])
        tps = point["output_tokens_per_s"]
        price = doc["prices_usd_per_gpu_hour"][s["setting"]]
        rows.append([s["setting"], s["dataset"], s["policy"], s["allocator"], f"{point['rate']:.3g}",
                     f"{tps:.0f}", f"{price / 3600 / tps * 1e6:.3f}"])
    return tabulate(rows, headers=["setting", "dataset", "policy", "KV manager", "rate (req/s)",
                                   "output tokens/s per GPU", "USD per 1M output tokens"], tablefmt="github")


def speed_line(doc: dict) -> str:
    points = [p for s in doc["searches"] for p in s["points"]]
    tokens = sum(p["generated_tokens"] for p in points)
    wall = sum(p["wall_s"] for p in points)
    return (f"{len(points)} simulations, {tokens:,} simulated tokens in {wall:.0f} s of simulation "
            f"({tokens / wall:,.0f} tokens per wall second per process); the study took {doc.get('wall_s', 0):.0f} s.")


def markdown(doc: dict) -> str:
    slots = "\n".join(f"**{name}**: {v['num_slots']:,} KV slots\n\n```\n" + "\n".join(v["derivation"]) + "\n```"
                      for name, v in doc["kv_slots"].items())
    t = doc["config"]["thresholds"]
    return f"""# Serving: request rate at equal latency (the vLLM paper's Fig. 12), memory (Fig. 2, 13), cost

Generated by `python -m pagedbench.bench --only serving_study`; do not edit.

Capacity = the highest Poisson request rate whose normalized latency (mean end-to-end latency / output
tokens) stays below {t[0]}× the low-load value ({t[1]}× shown beside it to show how much the choice of threshold
matters), found by bisection on one seed per point. "≥": the threshold was never crossed (the whole trace fit
the KV pool at once), so the rate is a lower bound.

## Capacity and the ratio of paged to each Orca variant

{capacity_table(doc)}

## KV memory at the paper's rates (Fig. 2 token states, Fig. 13 mean batch)

{memory_table(doc)}

## Cost at capacity (threshold {t[0]}×)

{cost_table(doc)}

## Assumptions

{ASSUMPTIONS}

## KV slots

{slots}

## Speed

{speed_line(doc)}

{environment_markdown(doc["environment"])}
"""


def plot(doc: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _by([s for s in doc["searches"] if s["policy"] == doc["config"]["policies"][0]], "setting", "dataset")
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, ((setting, dataset), searches) in zip(axes[0], sorted(groups.items())):
        for s in sorted(searches, key=lambda s: s["allocator"]):
            pts = sorted(s["points"], key=lambda p: p["rate"])
            ax.plot([p["rate"] for p in pts], [p["normalized_latency_s"] for p in pts], "o-", ms=3,
                    label=s["allocator"])
        low = searches[0]["low_load_normalized_latency_s"]
        ax.axhline(doc["config"]["thresholds"][0] * low, color="grey", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{setting}\n{dataset}", fontsize=9)
        paper = [f"{alloc.removeprefix('Orca ')}: {ratio}" for (ds, alloc), ratio in PAPER_RATIOS.items()
                 if ds == dataset and ratio[0].isdigit()]
        if paper:  # the paper's Fig. 12 ratios (paged / Orca), to read the curves against
            ax.text(0.02, 0.98, "paper, paged / Orca\n" + "\n".join(paper), transform=ax.transAxes,
                    fontsize=6, va="top", color="grey")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    records.save_figure(fig, Path(out) / "serving_latency.png", dpi=110)
    plt.close(fig)
