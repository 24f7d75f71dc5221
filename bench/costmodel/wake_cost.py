"""What waking an idle engine costs: the extra time of the first step after the loop waited for an arrival.

A step prices by its shape alone (:class:`~bench.costmodel.batched_cost.BatchedStepCost`), but on a
CPU the same shape runs slower when it starts an engine that sat idle: while the loop slept, other
processes used the caches the model's weights were in, and the step reads them back from memory. The
calibration measures it directly, as pairs: a lone prompt's first step right after the previous
request (warm), and the same step after an idle wait of ``gap`` seconds; the median difference per wait
is :attr:`WakeCost.extra_s`. Between the measured waits the cost is interpolated linearly (from 0 at no
wait), and held at the longest wait's value beyond it.

A step-time function carries it as ``step_time_s.wake_s`` (:func:`with_wake`); the serving simulator
adds ``wake_s(gap)`` to the first step after it jumped its clock ``gap`` seconds to an arrival. Only
the first step is charged: the next one is slower too, by less (recorded as ``second_extra_s``, not
charged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class WakeCost:
    """Median extra seconds of the first (and, not charged, the second) step after an idle wait of each
    of ``gaps_s``; ``pairs`` (warm, after-wait) first-step seconds per gap, kept for the record."""

    gaps_s: tuple[float, ...]
    extra_s: tuple[float, ...]
    second_extra_s: tuple[float, ...] = ()
    pairs: tuple[tuple[tuple[float, float], ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.gaps_s or len(self.gaps_s) != len(self.extra_s):
            raise ValueError(f"expected one extra time per gap, got {len(self.gaps_s)} gaps and "
                             f"{len(self.extra_s)} extra times")
        if any(g <= 0 for g in self.gaps_s) or list(self.gaps_s) != sorted(set(self.gaps_s)):
            raise ValueError(f"gaps must be > 0 and strictly increasing, got {list(self.gaps_s)}")

    def __call__(self, gap_s: float) -> float:
        """Extra seconds of the first step after an idle wait of ``gap_s`` (never below 0)."""
        if gap_s <= 0:
            return 0.0
        extra = np.interp(gap_s, (0.0, *self.gaps_s), (0.0, *self.extra_s))
        return max(0.0, float(extra))

    @classmethod
    def measured(cls, gaps_s: Sequence[float], first: Sequence[Sequence[tuple[float, float]]],
                 second: Sequence[Sequence[tuple[float, float]]] = ()) -> WakeCost:
        """From (warm, after-wait) step seconds per gap: the first steps (``first``) and, optionally, the
        steps after them (``second``)."""
        if len(first) != len(gaps_s) or any(not p for p in first):
            raise ValueError(f"expected a non-empty list of pairs per gap ({len(gaps_s)}), got {len(first)}")

        def median_extra(pairs) -> float:
            return float(np.median([after - warm for warm, after in pairs]))

        return cls(tuple(float(g) for g in gaps_s), tuple(median_extra(p) for p in first),
                   tuple(median_extra(p) for p in second),
                   tuple(tuple((float(w), float(a)) for w, a in p) for p in first))

    def to_record(self) -> dict:
        return {"gaps_s": list(self.gaps_s), "extra_s": list(self.extra_s),
                "second_extra_s": list(self.second_extra_s),
                "pairs": [[list(p) for p in gap] for gap in self.pairs]}

    @classmethod
    def from_record(cls, record: dict) -> WakeCost:
        return cls(tuple(record["gaps_s"]), tuple(record["extra_s"]), tuple(record.get("second_extra_s", ())),
                   tuple(tuple(tuple(p) for p in gap) for gap in record.get("pairs", ())))


def with_wake(step_time_s: Callable, wake: WakeCost | None) -> Callable:
    """``step_time_s`` carrying ``wake`` as its ``wake_s`` (and any ``decode_run`` it had); unchanged for None."""
    if wake is None:
        return step_time_s

    def timed(shape) -> float:
        return step_time_s(shape)

    timed.wake_s = wake
    own = getattr(step_time_s, "decode_run", None)
    if own is not None:
        timed.decode_run = own
    return timed
