"""A prefill's aftermath, bounded: what the fit takes off a step and what a prediction charges back.

The aftermath (:mod:`pagedbench.bench.costmodel.after_prefill`) is a median measured on other steps than the
one it is taken off or charged to, so on a loaded machine it can exceed a step, or come out negative and
larger than one. :func:`steady_samples` keeps each fit sample at least :data:`MIN_STEADY_SHARE` of its
measured time (counting those held there) and :class:`PricedAfterPrefill` prices each decode step after a
prefill between that share and its inverse times its shape's cost: a prefill is taken to at most double a
step, or halve it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedbench.bench.costmodel import StepSample
from pagedbench.bench.costmodel.after_prefill import AfterPrefillCost
from pagedbench.bench.studies.calibrate.shapes import CLOCKS, step_batch

if TYPE_CHECKING:
    from pagedbench.bench.studies.calibrate.steps import TimedStep


#: the least share of its measured time a step keeps once a prefill's aftermath is taken off it. The
#: aftermath is a median over other steps (the after-prefill runs), not this step's own: on a loaded machine
#: a noisy median, or a step that happened to run fast, can make it exceed the step itself, which would leave
#: a steady-state time of zero or less (no step costs that) or a tiny one that a fit on relative error weighs
#: without bound. The largest aftermath measured on a quiet machine is well under half of the smallest step
#: (a few tenths of a millisecond against a fixed cost of about 2 ms), so a step is never taken below half
#: of what it measured, and each step held at that floor is counted and reported.
MIN_STEADY_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class SteadySamples:
    """The fit's samples: the steps less a prefill's aftermath, each kept at least ``min_steady_share`` of its
    measured time; ``num_clipped`` steps were held at that floor (their aftermath was larger than it allows)."""

    samples: tuple[StepSample, ...]
    num_clipped: int
    min_steady_share: float

    def to_record(self) -> dict:
        return {"num_samples": len(self.samples), "num_clipped": self.num_clipped,
                "min_steady_share": self.min_steady_share}


def steady_samples(steps: Sequence[TimedStep], clock: str = "wall", after: AfterPrefillCost | None = None,
                   min_steady_share: float = MIN_STEADY_SHARE) -> SteadySamples:
    """The steps (in the order they ran) as fit samples; with ``after``, each less the extra time a prefill
    before it costs it (the shape's steady-state time), never below ``min_steady_share`` of the step's own
    measured time (:data:`MIN_STEADY_SHARE`; the steps held there are counted)."""
    if not 0 < min_steady_share <= 1:
        raise ValueError(f"min_steady_share must be in (0, 1], got {min_steady_share!r}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    bad = [s.seconds(clock) for s in steps if not s.seconds(clock) > 0]
    if bad:
        raise ValueError(f"every measured step needs {clock} seconds > 0, got {bad[:3]}")
    extras = after.extras_in_order(s.shape for s in steps) if after is not None else [0.0] * len(steps)
    samples, clipped = [], 0
    for s, x in zip(steps, extras):
        measured = s.seconds(clock)
        floor = min_steady_share * measured
        if measured - x < floor:
            clipped += 1
        samples.append(StepSample(step_batch(s.shape), max(measured - x, floor)))
    return SteadySamples(tuple(samples), clipped, min_steady_share)


class PricedAfterPrefill:
    """``after`` as it is charged beside ``cost``'s step times: a decode step after a prefill is priced between
    :data:`MIN_STEADY_SHARE` and 1 / :data:`MIN_STEADY_SHARE` times its shape's cost, the bound
    :func:`steady_samples` keeps on the fit's side (a step at most twice, at least half, its steady time). A
    median aftermath can come out negative and larger than a step (on a loaded machine the steady steps it is
    timed against ran slow), and a step of negative length is no price (the simulator's clock cannot run
    back); or several times a step, which no cache refill costs. It is what the serving simulator reads as
    ``step_time_s.after_prefill_s`` (its ``tracker()``), so the simulator, :func:`predicted_s` and the online
    check charge the same extras."""

    def __init__(self, after: AfterPrefillCost, cost, min_steady_share: float = MIN_STEADY_SHARE) -> None:
        if not 0 < min_steady_share <= 1:
            raise ValueError(f"min_steady_share must be in (0, 1], got {min_steady_share!r}")
        self.after, self.cost, self.min_steady_share = after, cost, min_steady_share

    def tracker(self) -> _PricedTracker:
        return _PricedTracker(self)

    def extras_in_order(self, shapes) -> list[float]:
        t = self.tracker()
        return [t.extra(s) for s in shapes]


class _PricedTracker:
    """The after-prefill tracker of :class:`PricedAfterPrefill`: the measured extra, floored per step."""

    def __init__(self, priced: PricedAfterPrefill) -> None:
        self.inner, self.priced = priced.after.tracker(), priced

    def extra(self, shape) -> float:
        x = self.inner.extra(shape)
        if x == 0:
            return x
        p = self.priced
        steady, share = p.cost.step_time_s(step_batch(shape)), p.min_steady_share
        # the step between share x and 1 / share x its steady time: the bounds steady_samples keeps
        return min(max(x, -(1.0 - share) * steady), (1.0 / share - 1.0) * steady)


def priced_after(after: AfterPrefillCost | None, cost) -> PricedAfterPrefill | None:
    """``after`` charged beside ``cost`` (:class:`PricedAfterPrefill`), or None."""
    return None if after is None else PricedAfterPrefill(after, cost)
