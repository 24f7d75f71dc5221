"""Arrival patterns: when each request of a trace arrives.

- ``poisson``: exponential gaps at ``rate`` requests/s;
- ``gamma``: gamma-distributed gaps with mean ``1 / rate`` and shape ``burstiness`` (as ``vllm bench
  serve --burstiness``): 1 is Poisson, below 1 burstier (the gaps' coefficient of variation is
  ``1 / sqrt(burstiness)``), above 1 more regular;
- ``constant``: one request every ``1 / rate`` s;
- trace replay (:func:`replay`): a trace's own timestamps times ``time_scale``; below 1 compresses them
  (a higher rate), above 1 stretches them, so a rate sweep on a real trace keeps its burst structure.

Arrival times start at the first gap (the first request does not arrive at 0), as in
:func:`pagedbench.bench.workloads.synthetic`. Every draw comes from ``numpy.random.default_rng(seed)``:
the same arguments give the same times.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
from pagedbench.bench.workloads import Request

PATTERNS = ("poisson", "gamma", "constant")


def arrival_times(pattern: str, num_requests: int, rate: float, *, burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """``num_requests`` increasing arrival times in seconds (float64), for ``pattern`` at ``rate`` req/s."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown arrival pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    if type(num_requests) is not int or num_requests < 1:
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 requests/s, got {rate!r}")
    if not (isinstance(burstiness, (int, float)) and math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    if pattern == "poisson" and burstiness != 1.0:
        raise ValueError(f"poisson arrivals have burstiness 1, got {burstiness}; use the gamma pattern")
    if pattern == "constant":
        return np.arange(1, num_requests + 1, dtype=np.float64) / rate
    rng = np.random.default_rng(seed)
    # gamma with shape k and scale 1 / (rate k): mean gap 1 / rate whatever k (k = 1: exponential)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), num_requests)
    return np.cumsum(gaps)


def with_arrivals(trace: tuple[Request, ...], times) -> tuple[Request, ...]:
    """``trace``'s requests (in order) arriving at ``times`` (one per request, non-decreasing)."""
    times = [float(t) for t in times]
    if len(times) != len(trace):
        raise ValueError(f"expected one arrival time per request ({len(trace)}), got {len(times)}")
    if any(not math.isfinite(t) or t < 0 for t in times) or any(b < a for a, b in itertools.pairwise(times)):
        raise ValueError("arrival times must be finite, >= 0 and non-decreasing")
    return tuple(dataclasses.replace(r, arrival_s=t) for r, t in zip(trace, times))


def mean_rate(trace: tuple[Request, ...]) -> float:
    """Requests per second over the trace's arrival span: (n - 1) / (last - first)."""
    if len(trace) < 2:
        raise ValueError(f"a rate needs at least 2 requests, got {len(trace)}")
    times = sorted(r.arrival_s for r in trace)
    span = times[-1] - times[0]
    if span <= 0:
        raise ValueError("every request arrives at the same time: the trace has no rate")
    return (len(trace) - 1) / span


def replay(trace: tuple[Request, ...], time_scale: float = 1.0) -> tuple[Request, ...]:
    """``trace`` with every arrival time multiplied by ``time_scale`` (< 1: compressed, a higher rate)."""
    if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    return tuple(dataclasses.replace(r, arrival_s=r.arrival_s * time_scale) for r in trace)


def time_scale_for_rate(trace: tuple[Request, ...], rate: float) -> float:
    """The time scale at which :func:`replay` gives ``trace`` a mean rate of ``rate`` requests/s."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0 requests/s, got {rate!r}")
    return mean_rate(trace) / rate
