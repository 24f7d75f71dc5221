"""Per-request serving metrics and their per-point summary, in the field's definitions and key names.

A request is seen as its :class:`RequestTiming` (arrival, the first time it was scheduled, the time each
output token came out). Its metrics (:func:`request_metrics`), all in seconds:

==================  ========================================================================
``ttft``            time to first token: first token out - arrival
``tpot``            time per output token *excluding the first*: (last token - first token) /
                    (output tokens - 1), as vLLM's and SGLang's benchmarks define it (GuideLLM
                    includes the first token); None for a one-token output
``itl``             inter-token latencies: the gaps between consecutive tokens (output - 1 of them)
``e2el``            end-to-end latency: last token out - arrival
``queue``           queueing delay: first scheduled - arrival
``normalized``      e2el / output tokens (the vLLM paper's Fig. 12 metric)
==================  ========================================================================

:func:`summarize` turns a point's requests into one flat dict whose keys are ``vllm bench serve``'s
where the metric is the same (``completed``, ``request_throughput``, ``output_throughput``,
``mean_ttft_ms``, ``median_tpot_ms``, ``p99_itl_ms``, ``std_e2el_ms``, ...; percentiles by linear
interpolation, ``numpy.percentile``'s default, as vLLM's). ITL percentiles are over every gap of every
request, as vLLM's. Queueing delay (``*_queue_ms``) and the normalized latency are ours.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: the percentiles a summary reports by default (vLLM's ``--metric-percentiles`` default is 99 only)
PERCENTILES = (50.0, 90.0, 99.0)
METRICS_MS = ("ttft", "tpot", "itl", "e2el", "queue")


class MetricsError(ValueError):
    """A timing or a summary request that cannot be right (names the field, expected and actual)."""


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """When things happened to one request, in seconds on the serving clock."""

    request_id: int
    arrival_s: float
    prompt_len: int
    output_len: int  # tokens the request asked for
    first_scheduled_s: float | None  # start of the first step that computed any of its tokens
    token_times_s: tuple[float, ...]  # when each output token came out (end of its step), in order

    @property
    def finished(self) -> bool:
        return len(self.token_times_s) == self.output_len


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """One finished request's metrics in seconds (see the module docstring)."""

    request_id: int
    prompt_len: int
    output_len: int
    ttft_s: float
    tpot_s: float | None  # None for a one-token output
    itl_s: tuple[float, ...]
    e2el_s: float
    queue_s: float

    @property
    def normalized_latency_s(self) -> float:
        return self.e2el_s / self.output_len


def request_metrics(t: RequestTiming) -> RequestMetrics:
    """The metrics of a finished request; :class:`MetricsError` for an unfinished or inconsistent one."""
    times = t.token_times_s
    if not t.finished:
        raise MetricsError(f"request {t.request_id}: {len(times)} of {t.output_len} tokens out; only a "
                           "finished request has metrics")
    if t.first_scheduled_s is None or t.first_scheduled_s < t.arrival_s:
        raise MetricsError(f"request {t.request_id}: first_scheduled_s must be >= arrival_s {t.arrival_s}, "
                           f"got {t.first_scheduled_s}")
    if times[0] < t.first_scheduled_s or any(b < a for a, b in itertools.pairwise(times)):
        raise MetricsError(f"request {t.request_id}: token times must be non-decreasing from the first "
                           f"scheduling ({t.first_scheduled_s}), got {times[:4]}...")
    n = len(times)
    return RequestMetrics(
        request_id=t.request_id, prompt_len=t.prompt_len, output_len=n,
        ttft_s=times[0] - t.arrival_s,
        tpot_s=(times[-1] - times[0]) / (n - 1) if n > 1 else None,
        itl_s=tuple(b - a for a, b in itertools.pairwise(times)),
        e2el_s=times[-1] - t.arrival_s,
        queue_s=t.first_scheduled_s - t.arrival_s,
    )


def metric_values_s(metrics: Sequence[RequestMetrics], name: str) -> list[float]:
    """Every value of metric ``name`` over ``metrics`` (ITL: every gap; TPOT: requests with > 1 token)."""
    if name == "itl":
        return [g for m in metrics for g in m.itl_s]
    if name == "tpot":
        return [m.tpot_s for m in metrics if m.tpot_s is not None]
    if name in ("ttft", "e2el", "queue"):
        return [getattr(m, f"{name}_s") for m in metrics]
    raise MetricsError(f"unknown metric {name!r}; known: {', '.join(METRICS_MS)}")


def _percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"  # vLLM's p{word}_..._ms


def distribution_ms(values_s: Sequence[float], name: str, percentiles: Sequence[float] = PERCENTILES) -> dict:
    """``mean_/median_/std_/p{P}_<name>_ms`` of ``values_s`` (seconds in, milliseconds out); None when
    there are no values."""
    if not values_s:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", *map(_percentile_key, percentiles))}
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
           f"std_{name}_ms": float(a.std())}
    for p, v in zip(percentiles, np.percentile(a, percentiles)):
        out[f"{_percentile_key(p)}_{name}_ms"] = float(v)
    return out


def summarize(metrics: Sequence[RequestMetrics], duration_s: float, *,
              percentiles: Sequence[float] = PERCENTILES) -> dict:
    """One point's summary over the finished requests ``metrics``, served over ``duration_s`` seconds.

    Throughputs are the requests' counts over ``duration_s`` (for a measured window: the window's
    length). Keys follow ``vllm bench serve`` (module docstring).
    """
    if not duration_s > 0 or math.isinf(duration_s):
        raise MetricsError(f"duration_s must be a positive finite number of seconds, got {duration_s}")
    bad = [p for p in percentiles if not 0 <= p <= 100]
    if bad:
        raise MetricsError(f"percentiles must be in [0, 100], got {bad}")
    inputs = sum(m.prompt_len for m in metrics)
    outputs = sum(m.output_len for m in metrics)
    doc = {"duration": duration_s, "completed": len(metrics), "total_input_tokens": inputs,
           "total_output_tokens": outputs, "request_throughput": len(metrics) / duration_s,
           "output_throughput": outputs / duration_s, "total_token_throughput": (inputs + outputs) / duration_s}
    for name in METRICS_MS:
        doc.update(distribution_ms(metric_values_s(metrics, name), name, percentiles))
    doc["mean_normalized_latency_s"] = (sum(m.normalized_latency_s for m in metrics) / len(metrics)
                                        if metrics else None)
    return doc
