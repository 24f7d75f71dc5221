"""Capacities of several KV managers on the same arrivals, and their paired ratios: the method of the
paper's throughput figures (Fig. 14, 16, 17) over :func:`pagedbench.bench.sim.serving_search.search`.

For each dataset, the low-load normalized latency is measured once per seed with the *reference* manager
(the first one listed) at :func:`~pagedbench.bench.sim.serving_search.low_load_rate`; each manager's
capacity is then the highest rate whose normalized latency stays within ``threshold`` times it (the
overload test failing every rate past the knee). Ratios of two managers' capacities are paired by seed
(:func:`~pagedbench.bench.sim.capacity_search.ratio_estimate`: the same arrivals on both sides).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from pagedbench.bench.common import sweep_runner
from pagedbench.bench.sim.capacity_search import ratio_estimate
from pagedbench.bench.sim.points import Method, Point, run_point
from pagedbench.bench.sim.serving_search import low_load_rate, search
from pagedbench.bench.sim.settings import Dataset, Setting
from pagedbench.bench.sim.simulator import AllocatorSpec


@dataclass(frozen=True, slots=True)
class Contender:
    """A KV manager as a figure names it: an allocator and whether its prefix cache is on."""

    label: str
    allocator: AllocatorSpec
    prefix_caching: bool = False


def _search_job(args) -> dict:
    return search(*args)


def capacities(setting: Setting, datasets: list[Dataset], contenders: list[Contender], *, seeds: tuple[int, ...],
               method: Method, max_seq_len: int, kv_slots: int, threshold: float, steps: int, policy: str,
               workers: int = 1, progress: Callable[[str], None] | None = None) -> list[dict]:
    """Every (dataset, contender, seed) capacity search, each result labelled with ``dataset`` and
    ``contender`` (module docstring)."""
    ref = contenders[0]
    lows = [(d, seed, Point(setting, dataclasses.replace(d, prefix_caching=ref.prefix_caching), ref.allocator, policy,
                            low_load_rate(setting, d, max_seq_len), seed, max_seq_len, kv_slots, False, method))
            for d in datasets for seed in seeds]
    low_rows = sweep_runner.map_points(run_point, [p for _, _, p in lows], workers=workers)
    name = str(threshold)
    jobs, labels = [], []
    for (d, _, low), row in zip(lows, low_rows):
        if row.get("normalized_latency_s") is None:
            raise RuntimeError(f"{d.name}: the low-load point has no latency (overloaded at {low.rate:.3g} req/s?)")
        for c in contenders:
            base = dataclasses.replace(low, allocator=c.allocator,
                                       dataset=dataclasses.replace(d, prefix_caching=c.prefix_caching))
            jobs.append((base, row["normalized_latency_s"], [name], steps))
            labels.append((d.name, c.label))
    out = []
    for (dataset, label), res in zip(labels, sweep_runner.imap_points(_search_job, jobs, workers=workers)):
        res["dataset"], res["contender"] = dataset, label
        out.append(res)
        if progress is not None:
            cap = res["capacity"][name]
            got = "none" if cap is None else f"{cap:.3g}"
            progress(f"  {dataset} {label} seed {res['seed']}: capacity {got} req/s")
    return out


def paired_ratio(searches: list[dict], dataset: str, ours: str, theirs: str, criterion: str) -> dict | None:
    """``ours`` / ``theirs`` capacity on ``dataset``, paired by seed (None where either has none)."""
    def side(label: str) -> dict[int, dict]:
        return {s["seed"]: s for s in searches if s["dataset"] == dataset and s["contender"] == label}

    a, b = side(ours), side(theirs)
    seeds = sorted(set(a) & set(b))
    if not seeds or any(a[k]["capacity"][criterion] is None or b[k]["capacity"][criterion] is None for k in seeds):
        return None

    def pair(s: dict) -> tuple[float, float]:
        return s["capacity"][criterion], s["capacity_bracket"][criterion][1]

    e = ratio_estimate([pair(a[k]) for k in seeds], [pair(b[k]) for k in seeds])
    return {"mean": e.mean, "low": e.low, "high": e.high, "num_seeds": e.num_seeds}
