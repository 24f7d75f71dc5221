"""What waking an idle engine costs: the extra time of the first steps after the loop waited for an arrival.

A step prices by its shape alone (:class:`~bench.costmodel.batched_cost.BatchedStepCost`), but on a
CPU the same shape runs slower when it starts an engine that sat idle: while the loop slept, other
processes used the caches the model's weights and buffers were in, and the first steps read them back
from memory, the first most. The calibration measures it directly, as pairs: a lone prompt's first steps
right after the previous request (warm), and the same steps after an idle wait of ``gap`` seconds; the
median difference per wait and step is :attr:`WakeCost.extra_s`. Between the measured waits the cost is
interpolated linearly (from 0 at no wait), and held at the longest wait's value beyond it.

Waking has a second, smaller cost before the first step: the loop's pick-up, from the arrival it slept
until to the start of the step that serves it (the sleep's overshoot, queueing the request, planning the
step). It is measured in the same pairs, as the median per wait (:attr:`WakeCost.pickup_s`).

A step-time function carries it as ``step_time_s.wake_s`` (:func:`with_wake`); the serving simulator
jumps its clock to ``pickup(gap)`` past an arrival it skipped ``gap`` seconds to, and adds
``wake_s(gap)[i]`` to the ``i``-th step after the jump.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Pair = tuple[float, float]  # (warm, after the wait) seconds of one step


@dataclass(frozen=True, slots=True)
class WakeCost:
    """``extra_s[g][i]``: median extra seconds of the ``i``-th step after an idle wait of ``gaps_s[g]``;
    ``pairs[g][i]``: the (warm, after-wait) step seconds it comes from, kept for the record;
    ``pickup_s[g]``: the median pick-up after that wait (empty: not measured, none charged), from
    ``pickups[g]``."""

    gaps_s: tuple[float, ...]
    extra_s: tuple[tuple[float, ...], ...]
    pairs: tuple[tuple[tuple[Pair, ...], ...], ...] = ()
    pickup_s: tuple[float, ...] = ()
    pickups: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.gaps_s or len(self.gaps_s) != len(self.extra_s):
            raise ValueError(f"expected one row of extra times per gap, got {len(self.gaps_s)} gaps and "
                             f"{len(self.extra_s)} rows")
        if any(g <= 0 for g in self.gaps_s) or list(self.gaps_s) != sorted(set(self.gaps_s)):
            raise ValueError(f"gaps must be > 0 and strictly increasing, got {list(self.gaps_s)}")
        if len({len(row) for row in self.extra_s}) != 1 or not self.extra_s[0]:
            raise ValueError(f"expected the same number (>= 1) of steps for every gap, got "
                             f"{[len(row) for row in self.extra_s]}")
        if self.pickup_s and (len(self.pickup_s) != len(self.gaps_s) or min(self.pickup_s) < 0):
            raise ValueError(f"expected one pick-up time >= 0 per gap ({len(self.gaps_s)}), got {list(self.pickup_s)}")

    def pickup(self, gap_s: float) -> float:
        """The loop's pick-up after an idle wait of ``gap_s`` (0 for no wait; between the measured waits
        interpolated, outside them held)."""
        if gap_s <= 0 or not self.pickup_s:
            return 0.0
        return float(np.interp(gap_s, self.gaps_s, self.pickup_s))

    @property
    def num_steps(self) -> int:
        return len(self.extra_s[0])

    def __call__(self, gap_s: float) -> tuple[float, ...]:
        """Extra seconds of each of the first :attr:`num_steps` steps after an idle wait of ``gap_s`` (each
        never below 0; all 0 for no wait)."""
        if gap_s <= 0:
            return (0.0,) * self.num_steps
        xs = (0.0, *self.gaps_s)
        return tuple(max(0.0, float(np.interp(gap_s, xs, (0.0, *(row[i] for row in self.extra_s)))))
                     for i in range(self.num_steps))

    @classmethod
    def measured(cls, gaps_s: Sequence[float], pairs: Sequence[Sequence[Sequence[Pair]]],
                 pickups: Sequence[Sequence[float]] = ()) -> WakeCost:
        """From ``pairs[g][i]``: the (warm, after-wait) seconds of step ``i`` after the wait ``gaps_s[g]``, and
        ``pickups[g]``: the pick-ups after it (clipped at 0: a timer that read early picked up at once)."""
        if len(pairs) != len(gaps_s) or any(not step for gap in pairs for step in gap):
            raise ValueError(f"expected non-empty pairs per gap ({len(gaps_s)}) and step")
        if pickups and (len(pickups) != len(gaps_s) or any(not p for p in pickups)):
            raise ValueError(f"expected non-empty pick-up times per gap ({len(gaps_s)})")
        extra = tuple(tuple(float(np.median([after - warm for warm, after in step])) for step in gap) for gap in pairs)
        return cls(tuple(float(g) for g in gaps_s), extra,
                   tuple(tuple(tuple((float(w), float(a)) for w, a in step) for step in gap) for gap in pairs),
                   tuple(max(0.0, float(np.median(p))) for p in pickups),
                   tuple(tuple(float(x) for x in p) for p in pickups))

    def to_record(self) -> dict:
        return {"gaps_s": list(self.gaps_s), "extra_s": [list(row) for row in self.extra_s],
                "pairs": [[[list(p) for p in step] for step in gap] for gap in self.pairs],
                "pickup_s": list(self.pickup_s), "pickups": [list(p) for p in self.pickups]}

    @classmethod
    def from_record(cls, record: dict) -> WakeCost:
        return cls(tuple(record["gaps_s"]), tuple(tuple(row) for row in record["extra_s"]),
                   tuple(tuple(tuple(tuple(p) for p in step) for step in gap) for gap in record.get("pairs", ())),
                   tuple(record.get("pickup_s", ())), tuple(tuple(p) for p in record.get("pickups", ())))


def with_wake(step_time_s: Callable, wake: WakeCost | None, after_prefill=None) -> Callable:
    """``step_time_s`` carrying ``wake`` as its ``wake_s`` and ``after_prefill`` (an
    :class:`~pagedbench.bench.costmodel.after_prefill.AfterPrefillCost`) as its ``after_prefill_s``; unchanged
    for neither. (It carries no ``decode_run``: a fast-forward prices a run of steps by shape alone, so the
    simulator steps one at a time.)"""
    if wake is None and after_prefill is None:
        return step_time_s

    def timed(shape) -> float:
        return step_time_s(shape)

    timed.wake_s = wake
    timed.after_prefill_s = after_prefill
    return timed
