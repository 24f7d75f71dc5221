"""The tables of a paired-capacity study's report (:mod:`pagedbench.bench.sim.paired_capacity`'s searches
and ratios): capacities per workload and contender, KV use at capacity, and the paired ratios beside the
paper's."""

from __future__ import annotations

from tabulate import tabulate

__all__ = ["capacity_table", "kv_use_table", "ratio_table"]


def _rate(x: float | None) -> str:
    return "none" if x is None else f"{x:.3g}"


def capacity_table(doc: dict) -> str:
    crit = doc["criterion"]
    contenders = list(dict.fromkeys(s["contender"] for s in doc["searches"]))
    rows = []
    for d in dict.fromkeys(s["dataset"] for s in doc["searches"]):
        row = [d]
        for c in contenders:
            caps = [s["capacity"][crit] for s in doc["searches"] if s["dataset"] == d and s["contender"] == c]
            row.append(" / ".join(_rate(x) for x in caps))
        rows.append(row)
    return tabulate(rows, ["workload", *(f"{c} (req/s)" for c in contenders)], tablefmt="github")


def kv_use_table(doc: dict) -> str:
    """Each contender's peak KV use at its capacity point (first seed): whether memory binds there."""
    crit, rows = doc["criterion"], []
    first = doc["config"]["seeds"][0]
    for s in doc["searches"]:
        cap = s["capacity"][crit]
        point = next((p for p in s["points"] if p["rate"] == cap), None) if s["seed"] == first else None
        if point is not None:
            use = point["peak_used_slots"] / point["total_slots"]
            ttft = point.get("mean_ttft_ms", float("nan"))
            rows.append([s["dataset"], s["contender"], _rate(cap), f"{use:.0%}", point["num_preemptions"],
                         f"{ttft:.4g}"])
    return tabulate(rows, ["workload", "contender", "capacity (req/s)", "peak KV slots in use", "preemptions",
                           "mean TTFT (ms)"], tablefmt="github")


def ratio_table(doc: dict, paper_head: str = "paper (vLLM / Orca Oracle)") -> str:
    rows = []
    for r in doc["ratios"]:
        e = r["ratio"]
        got = "no capacity on one side" if e is None else (
            f"{e['mean']:.2f}x" + ("" if e["num_seeds"] < 2 and e["low"] == e["high"] else
                                   f" [{e['low']:.2f}, {e['high']:.2f}]"))
        paper = "-" if r["paper"] is None else f"{r['paper']}x"
        rows.append([r["dataset"], f"{r['ours']} / {r['versus']}", got, paper])
    return tabulate(rows, ["workload", "ratio", "ours (paired, 95% interval)", paper_head],
                    tablefmt="github")
