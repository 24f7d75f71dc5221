"""Comparing served requests' latencies: the simulator against two real runs of the same arrivals.

For each of TTFT, TPOT and E2E (:mod:`bench.common.serving_metrics`' definitions) and each request, the
simulator's value is compared with the mean of the two real runs' (relative error), beside the two real
runs' own spread (``|a - b| / mean``), which is the machine's noise. The distributions are compared by
p50/p90/p99 (relative error, and the real runs' spread of the same percentile) and by the two-sample
Kolmogorov-Smirnov statistic (:func:`ks_statistic`) of the simulator against each real run, beside the
statistic between the two real runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pagedbench.bench.common.serving_metrics import RequestMetrics, RequestTiming, request_metrics

METRICS = ("ttft", "tpot", "e2el")
QUANTILES = (0.5, 0.9, 0.99)


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs of ``a``
    and ``b`` (0: the same sample distribution, 1: disjoint ranges)."""
    x, y = np.sort(np.asarray(a, dtype=np.float64)), np.sort(np.asarray(b, dtype=np.float64))
    if x.size == 0 or y.size == 0:
        raise ValueError(f"both samples must be non-empty, got sizes {x.size} and {y.size}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("both samples must be finite")
    points = np.concatenate([x, y])  # the CDFs only step at the samples' values
    cdf_x = np.searchsorted(x, points, side="right") / x.size
    cdf_y = np.searchsorted(y, points, side="right") / y.size
    return float(np.max(np.abs(cdf_x - cdf_y)))


def _values(metrics: Sequence[RequestMetrics], name: str) -> dict[int, float]:
    """request_id -> the metric's value in seconds (TPOT: only requests with more than one token)."""
    attr = f"{name}_s"
    return {m.request_id: getattr(m, attr) for m in metrics if getattr(m, attr) is not None}


def _metrics(timings: Sequence[RequestTiming], label: str) -> list[RequestMetrics]:
    unfinished = [t.request_id for t in timings if not t.finished]
    if unfinished:
        raise ValueError(f"{label}: every request must finish, unfinished: {unfinished[:8]}")
    return [request_metrics(t) for t in timings]


def compare_metric(a: dict[int, float], b: dict[int, float], sim: dict[int, float]) -> dict:
    """One metric: per-request error and spread, percentiles and KS (``a``, ``b``: the real runs)."""
    if not (a.keys() == b.keys() == sim.keys()) or not a:
        raise ValueError(f"the three runs must time the same requests, got {len(a)}, {len(b)} and {len(sim)}")
    ids = sorted(a)
    va, vb, vs = (np.array([d[i] for i in ids]) for d in (a, b, sim))
    real = 0.5 * (va + vb)
    if (real <= 0).any():
        raise ValueError("a real latency of 0 s cannot be a reference for a relative error")
    error, spread = vs / real - 1.0, np.abs(va - vb) / real
    quantiles = []
    for q in QUANTILES:
        qa, qb, qs = (float(np.quantile(v, q)) for v in (va, vb, vs))
        mean = 0.5 * (qa + qb)
        quantiles.append({"quantile": q, "real_a_s": qa, "real_b_s": qb, "sim_s": qs,
                          "rel_error": qs / mean - 1.0, "real_spread": abs(qa - qb) / mean})
    return {
        "num_requests": len(ids),
        "median_abs_rel_error": float(np.median(np.abs(error))),
        "median_signed_rel_error": float(np.median(error)),
        "real_spread_median": float(np.median(spread)),
        "quantiles": quantiles,
        "ks": {"sim_vs_real_a": ks_statistic(vs, va), "sim_vs_real_b": ks_statistic(vs, vb),
               "real_a_vs_real_b": ks_statistic(va, vb)},
    }


def compare_runs(real_a: Sequence[RequestTiming], real_b: Sequence[RequestTiming], sim: Sequence[RequestTiming],
                 *, goal_floor: float, goal_spread_factor: float) -> dict:
    """Every metric of :data:`METRICS` compared (:func:`compare_metric`), each with its goal: median
    per-request error <= max(``goal_floor``, ``goal_spread_factor`` x the real runs' median spread)."""
    runs = [_metrics(t, label) for t, label in ((real_a, "real run a"), (real_b, "real run b"), (sim, "simulator"))]
    out = {}
    for name in METRICS:
        section = compare_metric(*(_values(m, name) for m in runs))
        section["goal"] = max(goal_floor, goal_spread_factor * section["real_spread_median"])
        section["goal_met"] = section["median_abs_rel_error"] <= section["goal"]
        # a noisy machine widens the goal; the floor alone says whether the model is good in absolute terms
        section["floor_met"] = section["median_abs_rel_error"] <= goal_floor
        out[name] = section
    return out
