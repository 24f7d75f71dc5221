"""Service-level objectives: presets from the field, user-given ones, and whether a point meets them.

An :class:`SLO` is a set of targets; each target names a metric of :mod:`pagedbench.bench.common.serving_metrics`
(``ttft``, ``tpot``, ``itl``, ``e2el``, ``queue``), a limit in milliseconds and the share of requests that
must be within it. A point *meets* the SLO when, for every target, at least that share of its measured
requests is within the limit (:func:`attainment`). "p99 TTFT <= 2 s" (MLPerf's form) is the target
(ttft, 2000 ms, 99%): 99% of requests within 2 s is the nearest-rank p99 being within 2 s. DistServe's
form ("90% of requests within the TTFT target and 90% within the TPOT target") is two targets at 90%.
A request that never finished counts as missing every target; a one-token request has no TPOT and no
ITL, and meets those targets.

``request_goodput`` is vLLM's: requests per second that met *every* target of the SLO individually
(:func:`request_meets`), over the measured window.

Presets (:data:`PRESETS`):

- ``mlperf-llama-3.1-8b``: p99 TTFT 2 s, p99 TPOT 100 ms (MLPerf Inference server scenario limits);
- ``mlperf-llama-2-70b``: p99 TTFT 2 s, p99 TPOT 200 ms; ``mlperf-llama-2-70b-interactive``: 450 / 40 ms;
- ``mlperf-llama-3.1-405b``: p99 TTFT 6 s, p99 TPOT 175 ms; ``-interactive``: 4.5 s / 80 ms;
- ``distserve-llama-3.1-8b``: DistServe's attainment form (90% within TTFT, 90% within TPOT) on the
  MLPerf Llama-3.1-8B limits (2 s, 100 ms).

A user gives their own as ``"ttft:p99:2000,tpot:p90:100"`` (metric, share of requests, limit in ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedbench.bench.common.serving_metrics import METRICS_MS, RequestMetrics


class SLOError(ValueError):
    """An unknown preset or a malformed SLO (names what was given and what is known)."""


@dataclass(frozen=True, slots=True)
class SLOTarget:
    metric: str  # one of serving_metrics.METRICS_MS
    limit_ms: float  # the metric's limit
    share: float  # the share of requests that must be within it, in (0, 1]

    def __post_init__(self) -> None:
        if self.metric not in METRICS_MS:
            raise SLOError(f"unknown SLO metric {self.metric!r}; known: {', '.join(METRICS_MS)}")
        if not self.limit_ms > 0:
            raise SLOError(f"SLO limit for {self.metric} must be > 0 ms, got {self.limit_ms}")
        if not 0 < self.share <= 1:
            raise SLOError(f"SLO share for {self.metric} must be in (0, 1], got {self.share}")

    @property
    def label(self) -> str:
        return f"p{100 * self.share:g} {self.metric.upper()} ≤ {self.limit_ms:g} ms"


@dataclass(frozen=True, slots=True)
class SLO:
    name: str
    targets: tuple[SLOTarget, ...]
    source: str = "user-given"

    @property
    def label(self) -> str:
        return ", ".join(t.label for t in self.targets)


def _mlperf(name: str, ttft_ms: float, tpot_ms: float, what: str) -> SLO:
    return SLO(name, (SLOTarget("ttft", ttft_ms, 0.99), SLOTarget("tpot", tpot_ms, 0.99)),
               f"MLPerf Inference server-scenario latency limits, {what}")


PRESETS: dict[str, SLO] = {s.name: s for s in (
    _mlperf("mlperf-llama-3.1-8b", 2000, 100, "Llama-3.1-8B"),
    _mlperf("mlperf-llama-2-70b", 2000, 200, "Llama-2-70B"),
    _mlperf("mlperf-llama-2-70b-interactive", 450, 40, "Llama-2-70B interactive"),
    _mlperf("mlperf-llama-3.1-405b", 6000, 175, "Llama-3.1-405B"),
    _mlperf("mlperf-llama-3.1-405b-interactive", 4500, 80, "Llama-3.1-405B interactive"),
    SLO("distserve-llama-3.1-8b", (SLOTarget("ttft", 2000, 0.9), SLOTarget("tpot", 100, 0.9)),
        "DistServe's attainment form (90% within each target) on MLPerf's Llama-3.1-8B limits"),
)}


def parse_slo(text: str) -> SLO:
    """A preset's name, or targets ``metric:pNN:limit_ms`` joined by commas (module docstring)."""
    if not isinstance(text, str):
        raise SLOError(f"an SLO is a preset name or 'metric:pNN:limit_ms,...', got {type(text).__name__}")
    if text in PRESETS:
        return PRESETS[text]
    if ":" not in text:
        raise SLOError(f"unknown SLO preset {text!r}; known: {', '.join(PRESETS)} "
                       "(or give targets as 'ttft:p99:2000,tpot:p99:100')")
    targets = []
    for part in text.split(","):
        fields = part.strip().split(":")
        if len(fields) != 3 or not fields[1].startswith("p"):
            raise SLOError(f"SLO target {part.strip()!r}: expected 'metric:pNN:limit_ms' (e.g. 'ttft:p99:2000')")
        try:
            share, limit = float(fields[1][1:]) / 100, float(fields[2])
        except ValueError:
            raise SLOError(f"SLO target {part.strip()!r}: the share and the limit must be numbers") from None
        targets.append(SLOTarget(fields[0], limit, share))
    return SLO(text, tuple(targets))


def _within(m: RequestMetrics, target: SLOTarget) -> bool:
    limit_s = target.limit_ms / 1e3
    if target.metric == "tpot":
        return m.tpot_s is None or m.tpot_s <= limit_s
    if target.metric == "itl":
        return all(g <= limit_s for g in m.itl_s)
    return getattr(m, f"{target.metric}_s") <= limit_s


def attainment(metrics: Sequence[RequestMetrics], slo: SLO, *, num_unfinished: int = 0) -> dict[str, float]:
    """Per target (keyed by its metric), the share of requests within its limit; ``num_unfinished``
    measured requests that never finished count as outside every limit."""
    total = len(metrics) + num_unfinished
    if total == 0:
        raise SLOError("attainment of an SLO needs at least one measured request, got none")
    return {t.metric: sum(_within(m, t) for m in metrics) / total for t in slo.targets}


def slo_met(metrics: Sequence[RequestMetrics], slo: SLO, *, num_unfinished: int = 0) -> bool:
    got = attainment(metrics, slo, num_unfinished=num_unfinished)
    return all(got[t.metric] >= t.share for t in slo.targets)


def request_meets(m: RequestMetrics, slo: SLO) -> bool:
    """Whether one request met every target's limit (vLLM's goodput criterion)."""
    return all(_within(m, t) for t in slo.targets)


def request_goodput(metrics: Sequence[RequestMetrics], slo: SLO, duration_s: float) -> float:
    """Requests per second that met every target, over ``duration_s``."""
    if not duration_s > 0:
        raise SLOError(f"duration_s must be > 0, got {duration_s}")
    return sum(request_meets(m, slo) for m in metrics) / duration_s
