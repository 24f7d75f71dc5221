"""How well the serving study knows its headline numbers, and how many more replicates it needs.

A *group* is one (setting, dataset, policy, cost scale): its KV managers were served the same arrivals
and lengths per replicate (the seed draws them; common random numbers), so each ratio paged / manager is
estimated from the per-replicate ratios (:func:`~pagedbench.bench.sim.capacity_search.ratio_estimate`) and the
trace-to-trace luck they share cancels. A group's *headlines* are, per criterion, the paged capacity
(a log-scale interval: :func:`~pagedbench.bench.sim.capacity_search.log_estimate`) and each paged / manager
ratio. The study adds replicates to a group until every headline is within ``target_half_width`` (or its
cap), and the report prints each with its interval, or the reason it has none.
"""

from __future__ import annotations

import math
from collections import defaultdict

from pagedbench.bench.sim.capacity_search import (
    Estimate,
    log_estimate,
    ratio_estimate,
    relative_half_width,
)

__all__ = ["group_key", "groups", "headlines", "replicates_needed", "replicates_wanted", "widest"]


def group_key(search: dict) -> tuple:
    return search["setting"], search["dataset"], search["policy"], str(search["cost_scale"])


def is_paged(allocator: str) -> bool:
    return allocator.startswith("paged") and "prefix" not in allocator


def groups(searches: list[dict]) -> dict[tuple, dict[str, list[dict]]]:
    """``group key -> allocator -> its searches`` (one per replicate)."""
    out: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for s in searches:
        out[group_key(s)][s["allocator"]].append(s)
    return out


def _pairs(runs: list[dict], criterion: str) -> dict[int, tuple[float, float]]:
    """seed -> (capacity, failing rate) of the replicates that found a capacity."""
    out = {}
    for r in runs:
        cap, bracket = r["capacity"].get(criterion), r["capacity_bracket"].get(criterion)
        if cap is not None and bracket:
            out[r["seed"]] = (cap, bracket[1])
    return out


def headlines(by_allocator: dict[str, list[dict]], criteria: list[str]) -> tuple[dict[str, Estimate], dict[str, str]]:
    """A group's headline estimates (``"capacity paged @c"``, ``"paged / M @c"``) and, for those that
    cannot be estimated, the reason (``{label: reason}``)."""
    estimates: dict[str, Estimate] = {}
    reasons: dict[str, str] = {}
    paged_name = next((a for a in by_allocator if is_paged(a)), None)
    if paged_name is None:
        return estimates, reasons
    paged = by_allocator[paged_name]
    for c in criteria:
        ours = _pairs(paged, c)
        label = f"capacity {paged_name} @{c}"
        if len(ours) < len(paged):
            missing = next(r for r in paged if r["seed"] not in ours)
            reasons[label] = (f"replicate {missing['seed']} found no capacity: "
                              f"{missing['no_capacity_reason'].get(c, 'no bracket')}")
        else:
            estimates[label] = log_estimate([cap for cap, _ in ours.values()])
        for name, runs in by_allocator.items():
            if name == paged_name:
                continue
            theirs = _pairs(runs, c)
            seeds = sorted(set(ours) & set(theirs))
            label = f"{paged_name} / {name} @{c}"
            if len(seeds) < max(len(runs), len(paged)):
                reasons[label] = "a replicate of one side found no capacity (see its row)"
            else:
                estimates[label] = ratio_estimate([ours[s] for s in seeds], [theirs[s] for s in seeds])
    return estimates, reasons


def replicates_wanted(estimates: dict[str, Estimate], num_replicates: int, target: float, cap: int) -> int:
    """How many replicates a group should have: the current count where every headline is within
    +-``target``; else the count the widest one's half-width predicts (it shrinks as 1/sqrt(n)), at least
    one more, at most twice the current and never past ``cap``."""
    widths = [relative_half_width(e) for e in estimates.values()]
    widest = max(widths, default=0.0)
    if widest <= target or num_replicates >= cap:
        return num_replicates
    predicted = num_replicates * (widest / target) ** 2 if math.isfinite(widest) else 2 * num_replicates
    return int(min(cap, 2 * num_replicates, max(num_replicates + 1, math.ceil(predicted))))


def widest(estimates: dict[str, Estimate]) -> tuple[str, float] | None:
    """The headline with the widest interval and its half-width, or None for no estimate."""
    if not estimates:
        return None
    label = max(estimates, key=lambda k: relative_half_width(estimates[k]))
    return label, relative_half_width(estimates[label])


def replicates_needed(half_width: float, num_replicates: int, target: float) -> int | None:
    """About how many replicates would bring an interval of ``half_width`` at ``num_replicates`` within
    +-``target`` (a half-width shrinks as 1/sqrt(n)); None where the width says nothing (one replicate)."""
    if num_replicates < 2 or not math.isfinite(half_width):
        return None
    return max(num_replicates, math.ceil(num_replicates * (half_width / target) ** 2))
