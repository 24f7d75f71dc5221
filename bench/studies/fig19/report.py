"""The Figure 19 study's Markdown report, rendered from :func:`bench.studies.fig19.study.run_study`'s document;
only the paper's statement is written by hand (:data:`PAPER`)."""

from __future__ import annotations

import statistics

from pagedbench.bench.common.environment import environment_markdown
from tabulate import tabulate

#: the vLLM paper's Fig. 19 text (ANCHORS.md): what its two panels show
PAPER = ("\"recompute is never more than about 20% of swap's latency; they are comparable at block sizes "
         "16-64\" (ANCHORS.md; we read it as: recompute costs at most about 1.2x swap, swapping small blocks is "
         "slow for its many small PCIe transfers, and recompute's cost is flat in block size)")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.3g}"


def _cost_table(doc: dict) -> str:
    cfg = doc["config"]
    rows = [[r["block_size"], f"{r['bytes_per_block'] / 2**20:.3g}", _ms(r["swap_block_s"]),
             _ms(r["recompute_block_s"]), f"{r['swap_block_s'] / r['recompute_block_s']:.2f}",
             _ms(r["sequence_swap_out_in_s"]), _ms(r["sequence_swap_batched_s"]),
             _ms(r["sequence_recompute_s"])] for r in doc["cost_model"]]
    head = ["block size", "MiB / block", "swap 1 block (ms)", "recompute its tokens (ms)", "swap / recompute",
            f"swap out+in {cfg['sequence_tokens']} tok (ms)", "same, batched per layer (ms)",
            f"recompute {cfg['sequence_tokens']} tok (ms)"]
    return tabulate(rows, head, tablefmt="github")


def _cpu_table(doc: dict) -> str:
    rows = [[r["block_size"], r["num_blocks"], f"{r['bytes_per_block'] / 1024:.3g}",
             f"{1e6 * r['swap_out_in_block_s']:.3g}", f"{1e6 * r['recompute_block_s']:.3g}",
             f"{r['swap_out_in_block_s'] / r['recompute_block_s']:.3g}"] for r in doc["cpu_engine"]]
    head = ["block size", "blocks", "KiB / block", "swap out+in per block (us)", "recompute per block (us)",
            "swap / recompute"]
    return tabulate(rows, head, tablefmt="github")


def _with_interval(e: dict | None, fmt: str = ".3g") -> str:
    """``mean`` alone for one seed (no interval to speak of), else ``mean [low, high]``."""
    if e is None:
        return "-"
    mean = format(e["mean"], fmt)
    return mean if e["num_seeds"] < 2 else f"{mean} [{e['low']:{fmt}}, {e['high']:{fmt}}]"


def _mean_ms(e: dict | None) -> str:
    return _ms(None if e is None else e["mean"])


def _half_width(e: dict) -> float:
    """The 95% interval's half width as a share of the mean."""
    return (e["high"] - e["low"]) / 2 / e["mean"]


def _points(n: int) -> str:
    return f"{n} point" if n == 1 else f"{n} points"


def _sim_table(doc: dict) -> str:
    by = {}
    for p in doc["simulated"]:
        by.setdefault((p["block_size"], p["rate"]), {}).setdefault(p["mode"], []).append(p)

    def mean(ps, key):
        vals = [p[key] for p in ps if p[key] is not None]
        return sum(vals) / len(vals) if vals else float("nan")
    rows = []
    for r in doc["paired"]:
        modes = by[(r["block_size"], r["rate"])]
        rec, swap = modes["recompute"], modes["swap"]
        rows.append([r["block_size"], r["rate"], _mean_ms(r["recompute_s"]), _mean_ms(r["swap_s"]),
                     _with_interval(r["recompute_over_swap"], fmt=".3f"),
                     f"{mean(rec, 'num_preemptions'):.0f} / {mean(swap, 'num_preemptions'):.0f}",
                     f"{mean(swap, 'num_swapped_out_blocks'):.0f}", f"{mean(swap, 'copy_s'):.3g}"])
    head = ["block size", "rate (req/s)", "recompute (ms/token)", "swap (ms/token)", "recompute / swap (paired, 95% "
            "interval)", "preemptions (rec. / swap)", "blocks swapped out", "copy time (s)"]
    return tabulate(rows, head, tablefmt="github")


def _sim_verdict(doc: dict) -> str:
    """How far apart the two modes' end-to-end latencies are (recompute / swap, paired by seed), over every
    point, and where the 95% interval says which mode is faster."""
    ratios = [r["recompute_over_swap"] for r in doc["paired"] if r["recompute_over_swap"] is not None]
    if not ratios:
        return "No point has both modes' latency."
    means = [e["mean"] for e in ratios]
    line = (f"End to end, recompute's normalized latency is {min(means):.2f}x to {max(means):.2f}x swap's over "
            f"these {len(ratios)} points (below 1: recompute is faster)")
    if min(e["num_seeds"] for e in ratios) < 2:
        return line + "; one seed: no interval."
    faster = sum(e["high"] < 1 for e in ratios)
    slower = sum(e["low"] > 1 for e in ratios)
    modes = [r[k] for r in doc["paired"] for k in ("recompute_s", "swap_s") if r[k] and r[k]["num_seeds"] > 1]
    spread = statistics.median(_half_width(e) for e in modes)
    return (line + f". Paired over {ratios[0]['num_seeds']} seeds, the 95% interval lies below 1 (recompute "
            f"faster) at {_points(faster)}, above 1 (swap faster) at {_points(slower)}, and holds 1 at the other "
            f"{_points(len(ratios) - faster - slower)}. The pairing is what makes that visible: seed to seed, each "
            f"mode's own mean latency moves by +-{spread:.0%} (the median half width of its 95% interval; the "
            f"traces differ), the paired ratio by +-{statistics.median(_half_width(e) for e in ratios):.1%}.")


def markdown(doc: dict) -> str:
    cfg = doc["config"]
    crossover = [r["block_size"] for r in doc["cost_model"] if r["swap_block_s"] <= r["recompute_block_s"]]
    lines = [
        "# Fig. 19: swap or recompute, by block size", "",
        "Generated by `python -m pagedbench.bench fig19`.", "",
        environment_markdown(doc["environment"]),
        f"The paper (vLLM, SOSP 2023, Fig. 19): {PAPER}.", "",
        f"## (a) Per block: the cost model ({cfg['model']} on {cfg['hardware']})", "",
        "A block's copy over the host link (PCIe; `bench/costmodel/host_link.py`: 2 x layers transfers of the "
        "block, vLLM v0's per-block copies) against recomputing its tokens (their share of a "
        f"{cfg['sequence_tokens']}-token prefill step of the step-cost model); then a whole preempted sequence "
        f"of {cfg['sequence_tokens']} tokens swapped out and back in, against recomputing it (flat: recompute "
        "uses no block). The batched column prices our engine's layout (one gathered copy per layer for K and "
        "for V, whatever the number of blocks).", "",
        _cost_table(doc), "",
        f"Swapping a block costs no more than recomputing its tokens from block size "
        f"{min(crossover) if crossover else 'none'} up." if crossover else
        "Swapping a block costs more than recomputing its tokens at every block size.", "",
        f"## (a) Per block, measured on the CPU engine (the random `{cfg['cpu_model']}` model)", "",
        f"The engine's batched copy of a {cfg['cpu_sequence_tokens']}-token sequence's blocks to a host pool and "
        f"back, per block, against its prefill of {cfg['cpu_sequence_tokens']} tokens, per block (medians of "
        f"{cfg['cpu_repeats']}). Both pools are host memory here: this times the engine's copy path, not PCIe.", "",
        _cpu_table(doc), "",
        f"## (b) End to end: the simulator, {cfg['model']} on {cfg['hardware']}, ShareGPT-like, Poisson", "",
        f"The real scheduler with each preemption mode ({cfg['policy']} policy, {doc['kv_slots']:,} KV slots, "
        f"a {cfg['swap_space_gib']:g} GiB host pool), {cfg['span_s']:g} s of arrivals, seeds {list(cfg['seeds'])}; "
        "a swapping step lasts as much longer as its copies cost. Normalized latency: mean end-to-end latency "
        "per output token. recompute / swap is paired by seed (the same arrivals in both modes): the geometric "
        "mean of the per-seed ratios [the 95% Student-t interval of their logs]; the other columns are means "
        "over seeds (the record has each mode's interval too).", "",
        _sim_table(doc), "",
        _sim_verdict(doc), "",
        f"Wall time: {doc['wall_s']:.0f} s.", "",
    ]
    return "\n".join(lines)
