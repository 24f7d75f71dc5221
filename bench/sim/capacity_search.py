"""The highest offered rate at which a criterion holds: bracketing, then geometric bisection; and the
intervals that say how well it is known.

``passes(rate)`` runs (or looks up) a point and says whether the criterion holds there: a latency
threshold, an SLO. An overloaded point must fail every criterion (its latency is the length of a run,
not of the system), so a capacity is always the rate of a point that was measured, met the criterion
and was not overloaded: never a plateau, never a lower bound. The search assumes the criterion holds
below some knee and fails above it. With ``resolution`` the bisection runs until the bracket's two rates
are within that factor; with ``min_rate`` a criterion that fails at the first rate is searched downwards
(the rate divided by ``factor``) until it holds, else it gives no capacity with the reason; one still
holding at ``max_rate`` gives none either.

Intervals: a capacity over replicates is estimated on the log scale (:func:`log_estimate`: a geometric
mean whose interval can never reach 0); a ratio of two managers from the same replicates' arrivals is
paired (:func:`ratio_estimate`), and a tie is called only where that interval holds 1
(:func:`paired_verdict`). :func:`needs_more_replicates` says which estimates are not yet within the
target half-width, for a study that adds replicates until they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Capacity:
    rate: float | None  # the highest passing rate found (None: none passed, or none failed)
    bracket: tuple[float, float] | None  # (passing, failing) rates the bisection ended between
    reason: str  # why rate is None ("" otherwise)

    @property
    def resolution(self) -> float | None:
        """How far above ``rate`` the knee may lie: the bracket's ratio less 1 (0.02 = within 2%)."""
        return None if self.bracket is None else self.bracket[1] / self.bracket[0] - 1


def known_bracket(known: Mapping[float, bool]) -> tuple[float, float] | None:
    """The tightest (passing, failing) pair among rates already measured: the lowest failing rate and
    the highest passing rate below it (what bracketing from below would have stopped at), or None."""
    failing = [r for r, ok in known.items() if not ok]
    if not failing:
        return None
    hi = min(failing)
    below = [r for r, ok in known.items() if ok and r < hi]
    return (max(below), hi) if below else None


def find_capacity(passes: Callable[[float], bool], start: float, *, factor: float = 4.0, steps: int = 5,
                  max_rate: float = 1e6, resolution: float | None = None,
                  min_rate: float | None = None, known: Mapping[float, bool] | None = None,
                  widen: bool = False) -> Capacity:
    """Bracket from ``start`` by ``factor`` until a rate fails, then geometric bisections: ``steps`` of
    them, or with ``resolution`` as many as bring the bracket within a factor of ``1 + resolution``.

    Without ``resolution`` the result lies within a factor of ``factor ** (2 ** -steps)`` below the knee.
    A criterion failing at ``start`` is searched downwards to ``min_rate`` where one is given.
    ``known`` holds verdicts already measured (another criterion's points at the same rates): where they
    bracket the knee, bisection starts from :func:`known_bracket` and no rate is run twice. ``widen``
    squares the factor after each bracketing step that did not cross the knee, for a ``start`` near a
    guessed knee (an earlier replicate's capacity, with a small factor): a good guess costs two points,
    a bad one a few more, never the many steps of a small fixed factor.
    """
    if not start > 0 or not factor > 1 or steps < 0:
        raise ValueError(f"find_capacity needs start > 0, factor > 1, steps >= 0; got {start}, {factor}, {steps}")
    if resolution is not None and not resolution > 0:
        raise ValueError(f"resolution must be > 0, got {resolution}")
    if min_rate is not None and not 0 < min_rate <= start:
        raise ValueError(f"min_rate must be in (0, start={start:.3g}], got {min_rate}")
    bracket = known_bracket(known) if known else None
    if bracket is not None and bracket[1] <= max_rate and (min_rate is None or bracket[0] >= min_rate):
        return _bisect(passes, *bracket, steps, resolution)
    if not passes(start):
        if min_rate is None:
            return Capacity(None, None, f"fails already at the first rate {start:.3g}")
        hi = start
        lo = hi / factor
        while not passes(lo):
            if lo <= min_rate:
                return Capacity(None, None, f"fails at every rate down to {lo:.3g}, the search's floor")
            factor = factor ** 2 if widen else factor
            hi, lo = lo, max(lo / factor, min_rate)
    else:
        lo = start
        hi = lo * factor
        while passes(hi):
            lo = hi
            if lo >= max_rate:
                return Capacity(None, None, f"still holds at {lo:.3g}, the search's limit")
            factor = factor ** 2 if widen else factor
            hi = lo * factor
    return _bisect(passes, lo, hi, steps, resolution)


def _bisect(passes: Callable[[float], bool], lo: float, hi: float, steps: int, resolution: float | None) -> Capacity:
    done = 0
    while (hi / lo > 1 + resolution) if resolution is not None else done < steps:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
        done += 1
    return Capacity(lo, (lo, hi), "")


# Student's t, 97.5th percentile, by degrees of freedom (two-sided 95% interval); 30+ uses the normal's.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


@dataclass(frozen=True, slots=True)
class Estimate:
    """A mean over seeds with its two-sided 95% Student-t interval (``low == high == mean`` for one seed,
    which says nothing about the noise: ``num_seeds`` tells)."""

    mean: float
    low: float
    high: float
    num_seeds: int

    def overlaps(self, other: Estimate) -> bool:
        return self.low <= other.high and other.low <= self.high


def estimate(values: list[float]) -> Estimate:
    """The mean of ``values`` (one per seed) and its 95% interval."""
    n = len(values)
    if n == 0:
        raise ValueError("estimate needs at least one value")
    mean = sum(values) / n
    if n == 1:
        return Estimate(mean, mean, mean, 1)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half, n)


def compare(ours: Estimate, theirs: Estimate) -> str:
    """"tie" where the intervals overlap (or either rests on one seed and the means are within 5%),
    otherwise "higher" or "lower" for ``ours``."""
    if ours.overlaps(theirs):
        return "tie"
    if min(ours.num_seeds, theirs.num_seeds) == 1 and abs(ours.mean - theirs.mean) <= 0.05 * max(ours.mean,
                                                                                             theirs.mean):
        return "tie"
    return "higher" if ours.mean > theirs.mean else "lower"


def ratio_estimate(ours: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> Estimate:
    """The ratio ours / theirs of two managers' capacities over the same seeds (the same arrivals: a paired
    comparison, whose trace-to-trace noise cancels), from each seed's ``(capacity, failing rate)``.

    The interval is the wider of the 95% Student-t interval of the per-seed log ratios and the
    bisection's resolution (each capacity is known only to lie below its failing rate).
    """
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"ratio_estimate needs the same seeds on both sides, got {len(ours)} and {len(theirs)}")
    logs = [math.log(a / b) for (a, _), (b, _) in zip(ours, theirs)]
    e = estimate(logs)
    low = sum(a / b_hi for (a, _), (_, b_hi) in zip(ours, theirs)) / len(ours)
    high = sum(a_hi / b for (_, a_hi), (b, _) in zip(ours, theirs)) / len(ours)
    return Estimate(math.exp(e.mean), min(math.exp(e.low), low), max(math.exp(e.high), high), e.num_seeds)


def log_estimate(values: list[float]) -> Estimate:
    """The geometric mean of positive ``values`` (one per replicate) with the 95% interval of their
    logarithms, mapped back: it never reaches 0 or below, and its width reads as a factor."""
    if any(not v > 0 for v in values):
        raise ValueError(f"log_estimate needs positive values, got {sorted(values)[:3]}")
    e = estimate([math.log(v) for v in values])
    return Estimate(math.exp(e.mean), math.exp(e.low), math.exp(e.high), e.num_seeds)


def relative_half_width(e: Estimate) -> float:
    """Half the interval's width on the log scale, as a fraction (0.05 = within about +-5%); infinite
    for one replicate, whose interval says nothing of the noise."""
    if e.num_seeds < 2:
        return math.inf
    return math.sqrt(e.high / e.low) - 1 if e.low > 0 else math.inf


def needs_more_replicates(estimates: dict[str, Estimate], target: float = 0.05) -> list[str]:
    """The names of ``estimates`` whose interval is wider than +-``target``, widest first."""
    wide = [(relative_half_width(e), k) for k, e in estimates.items() if relative_half_width(e) > target]
    return [k for _, k in sorted(wide, reverse=True)]


def paired_verdict(ratio: Estimate) -> str:
    """"tie" only where the paired interval of ours / theirs holds 1, else "higher" or "lower" for ours."""
    if ratio.low <= 1 <= ratio.high:
        return "tie"
    return "higher" if ratio.low > 1 else "lower"
