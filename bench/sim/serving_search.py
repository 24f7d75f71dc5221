"""A serving point's capacities: the highest rate at which each criterion (a latency threshold over the
low-load latency, or an SLO) still holds, searched over the simulator's points (:func:`search`), and
the low-load rate they are measured against (:func:`low_load_rate`). The serving study and Fig. 14 search
the same way.
"""

from __future__ import annotations

import dataclasses

from pagedbench.bench import workloads
from pagedbench.bench.sim.capacity_search import find_capacity
from pagedbench.bench.sim.points import Point, cost_model, run_point
from pagedbench.bench.sim.settings import Dataset, Setting
from pagedbench.bench.workloads import sessions, trace_spans


def low_load_rate(setting: Setting, dataset: Dataset, max_seq_len: int) -> float:
    """A rate at which requests hardly ever overlap: one arrival per 50 mean request durations."""
    cost = cost_model(setting)
    if dataset.workload:
        w = sessions.workload(dataset.workload)
        mean_prompt, mean_output = w.mean_prompt, w.mean_output
    elif dataset.trace:
        mean_prompt, mean_output = trace_spans.mean_lengths(dataset.trace, max_seq_len, dataset.over_context)
    else:
        stats = workloads.DATASETS[dataset.dataset]
        mean_prompt, mean_output = stats.mean_prompt, stats.mean_output
    ctx = min(mean_prompt + mean_output / 2, max_seq_len)
    per_token = cost.time_from_totals_s(1, 1, int(ctx))
    return 1.0 / (50 * mean_output * per_token)


def criteria(thresholds: tuple[float, ...], slos: tuple[str, ...]) -> list[str]:
    return [str(t) for t in thresholds] + [f"slo:{name}" for name in slos]


def _passes(row: dict, criterion: str, low: float) -> bool:
    if row["overloaded"]:
        return False
    if criterion.startswith("slo:"):
        got = row.get("slo", {}).get(criterion[4:])
        return bool(got and got["met"])
    lat = row.get("normalized_latency_s")
    return lat is not None and lat <= float(criterion) * low


#: how far below the low-load rate a criterion failing at the first rate is searched for (rate / 4**3)
_DOWNWARD_FACTORS = 3


def allocator_label(base: Point) -> str:
    """The KV manager's name in a search's record (the prefix cache named where it is on)."""
    return base.allocator.name + (" + prefix cache" if base.dataset.prefix_caching
                                  and base.allocator.kind == "paged" else "")


def replicate_key(search_or_base: dict | Point) -> tuple:
    """What a search's replicates share (all but the seed), from its record or from its base point."""
    if isinstance(search_or_base, dict):
        s = search_or_base
        return s["setting"], s["dataset"], s["policy"], str(s["cost_scale"]), s["allocator"]
    b = search_or_base
    return (b.setting.name, b.dataset.name, b.policy, str([list(t) for t in b.cost_scale]), allocator_label(b))


#: a guessed capacity (an earlier replicate's) is bracketed from guess / this by this squared, widened
#: on a miss (``find_capacity(widen=True)``): replicates of one group rarely differ by more than 10%
_GUESS_FACTOR = 1.1


def search(base: Point, low: float, names: list[str], steps: int, resolution: float | None = None,
           guesses: dict[str, float] | None = None) -> dict:
    """Every criterion's capacity for one (setting, dataset, policy, KV manager, seed), and its points.

    With ``resolution`` each bisection runs until its bracket is within that factor, and a criterion that
    fails at the first rate is searched downwards (to the low-load rate / 64) instead of giving none.
    A criterion starts from the bracket the points already run for the others give, where they give one,
    else near its guess in ``guesses`` (the capacity earlier replicates found), else from the low-load
    rate x 4; the capacity found is a rate that was run and passed, whichever start was taken."""
    evaluated: dict[float, dict] = {}
    guesses = guesses or {}

    def row(rate: float) -> dict:
        if rate not in evaluated:
            evaluated[rate] = run_point(dataclasses.replace(base, rate=rate))
        return evaluated[rate]

    capacity, brackets, resolutions, reasons = {}, {}, {}, {}
    floor = None if resolution is None else base.rate / 4 ** _DOWNWARD_FACTORS
    for name in names:
        known = {r: _passes(p, name, low) for r, p in evaluated.items()}
        guess = guesses.get(name)
        start, factor = 4 * base.rate, 4.0
        if guess is not None and floor is not None and guess / _GUESS_FACTOR > floor:
            start, factor = guess / _GUESS_FACTOR, _GUESS_FACTOR ** 2
        c = find_capacity(lambda rate, name=name: _passes(row(rate), name, low), start, factor=factor, steps=steps,
                          resolution=resolution, min_rate=floor,
                          known=known, widen=factor != 4.0)
        capacity[name] = c.rate
        brackets[name] = list(c.bracket) if c.bracket else None
        resolutions[name] = c.resolution
        if c.reason:
            reasons[name] = c.reason
    points = [{"rate": r, **{k: v for k, v in p.items() if k != "rate"}} for r, p in sorted(evaluated.items())]
    achieved = [p for p in points if p["num_window_arrivals"] > 0]
    best = max(achieved, key=lambda p: p["achieved_rate"]) if achieved else None
    return {"setting": base.setting.name, "dataset": base.dataset.name, "allocator": allocator_label(base),
            "policy": base.policy, "seed": base.seed, "cost_scale": [list(t) for t in base.cost_scale],
            "max_seq_len": base.max_seq_len, "span_s": base.method.span_s, "low_load_normalized_latency_s": low,
            "capacity": capacity, "capacity_bracket": brackets,
            "capacity_resolution": resolutions,
            "no_capacity_reason": reasons,
            "saturation_rps": best["achieved_rate"] if best else None,
            "saturation_at_rate": best["rate"] if best else None,
            "peak_used_slots": max((p["peak_used_slots"] for p in points), default=0), "points": points}
