"""What a prefill costs the decode steps after it: the extra time of the first decode-only steps that follow a
step with a prefill chunk.

A step prices by its shape alone (:class:`~bench.costmodel.batched_cost.BatchedStepCost`), but on a CPU the
same decode batch runs slower right after a prefill than after a long stretch of decodes: the prefill's
activations pushed the weights and buffers out of the caches, and the next decode steps read them back, the
first most. A calibration grid whose decode steps mostly sit a few steps after a prefill (prompts join every
few steps) then fits decode costs that are too high for serving's long decode stretches.

The calibration measures it directly: ``B`` decoding sequences that a prompt of ``P`` tokens joins every
``stretch`` decode steps (for one step: it leaves after its prefill), the ``i``-th decode step after each join
timed against the same stretch's steps past :attr:`AfterPrefillCost.num_steps` (its steady state). The median
difference per ``(B, P, i)`` is :attr:`AfterPrefillCost.extra_s`; between the measured sizes it is
interpolated linearly (in ``P`` from 0 at no prefill; held beyond the largest ``P`` and outside the measured
batches).

The step-cost fit is made on the grid's steps less these extras (the steady-state cost of a shape), and the
serving simulator adds them back to the decode steps after each prefill (``step_time_s.after_prefill_s``),
in step order: :class:`AfterPrefillTracker` is the one place that follows the steps since the last prefill.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

Pair = tuple[float, float]  # (steady, after the prefill) seconds of one decode step


@dataclass(frozen=True, slots=True)
class AfterPrefillCost:
    """``extra_s[b][p][i]``: median extra seconds of the ``i+1``-th decode-only step after a step that prefilled
    ``prefill_tokens[p]`` tokens, with ``batches[b]`` sequences decoding; ``pairs[b][p][i]``: the (steady,
    after) step seconds it comes from, kept for the record."""

    batches: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    extra_s: tuple[tuple[tuple[float, ...], ...], ...]
    pairs: tuple[tuple[tuple[tuple[Pair, ...], ...], ...], ...] = ()

    def __post_init__(self) -> None:
        for name, sizes in (("batches", self.batches), ("prefill_tokens", self.prefill_tokens)):
            if not sizes or any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
                raise ValueError(f"{name} must be >= 1 and strictly increasing, got {list(sizes)}")
        shape = [(len(row), {len(r) for r in row}) for row in self.extra_s]
        if len(self.extra_s) != len(self.batches) or any(
                n != len(self.prefill_tokens) or len(lens) != 1 for n, lens in shape):
            raise ValueError(f"expected extra times for each of {len(self.batches)} batches x "
                             f"{len(self.prefill_tokens)} prefill sizes, got {[n for n, _ in shape]}")
        if len({len(r) for row in self.extra_s for r in row}) != 1 or not self.extra_s[0][0]:
            raise ValueError("expected the same number (>= 1) of steps for every batch and prefill size")

    @property
    def num_steps(self) -> int:
        return len(self.extra_s[0][0])

    def __call__(self, prefill_tokens: int, batch: int) -> tuple[float, ...]:
        """Extra seconds of each of the first :attr:`num_steps` decode steps of ``batch`` sequences after a
        step that prefilled ``prefill_tokens`` tokens (all 0 for none)."""
        if prefill_tokens <= 0 or batch <= 0:
            return (0.0,) * self.num_steps
        xs = (0, *self.prefill_tokens)
        by_batch = np.array([[np.interp(prefill_tokens, xs, (0.0, *(r[i] for r in row)))
                              for i in range(self.num_steps)] for row in self.extra_s])
        return tuple(float(np.interp(batch, self.batches, by_batch[:, i])) for i in range(self.num_steps))

    @classmethod
    def measured(cls, batches: Sequence[int], prefill_tokens: Sequence[int],
                 pairs: Sequence[Sequence[Sequence[Sequence[Pair]]]]) -> AfterPrefillCost:
        """From ``pairs[b][p][i]``: the (steady, after) seconds of decode step ``i + 1`` after the prefill."""
        if len(pairs) != len(batches) or any(len(row) != len(prefill_tokens) for row in pairs) or any(
                not step for row in pairs for cell in row for step in cell):
            raise ValueError(f"expected non-empty pairs per batch ({len(batches)}), prefill size "
                             f"({len(prefill_tokens)}) and step")
        extra = tuple(tuple(tuple(float(np.median([a - s for s, a in step])) for step in cell) for cell in row)
                      for row in pairs)
        kept = tuple(tuple(tuple(tuple((float(s), float(a)) for s, a in step) for step in cell) for cell in row)
                     for row in pairs)
        return cls(tuple(int(b) for b in batches), tuple(int(p) for p in prefill_tokens), extra, kept)

    def tracker(self) -> AfterPrefillTracker:
        return AfterPrefillTracker(self)

    def extras_in_order(self, shapes: Iterable) -> list[float]:
        """The extra seconds of each of ``shapes`` (:class:`~pagedbench.refengine.engine.core.StepShape`, in
        the order they ran)."""
        t = self.tracker()
        return [t.extra(s) for s in shapes]

    def to_record(self) -> dict:
        return {"batches": list(self.batches), "prefill_tokens": list(self.prefill_tokens),
                "extra_s": [[list(cell) for cell in row] for row in self.extra_s],
                "pairs": [[[[list(p) for p in step] for step in cell] for cell in row] for row in self.pairs]}

    @classmethod
    def from_record(cls, record: dict) -> AfterPrefillCost:
        return cls(tuple(record["batches"]), tuple(record["prefill_tokens"]),
                   tuple(tuple(tuple(cell) for cell in row) for row in record["extra_s"]),
                   tuple(tuple(tuple(tuple(tuple(p) for p in step) for step in cell) for cell in row)
                         for row in record.get("pairs", ())))


class AfterPrefillTracker:
    """Follows a sequence of steps in the order they run: how many decode-only steps since the last step with a
    prefill chunk, and how many tokens that step prefilled. A sequence's steps before its first prefill count
    as far from one (nothing to charge)."""

    __slots__ = ("cost", "prefill_tokens", "since")

    def __init__(self, cost: AfterPrefillCost) -> None:
        self.cost = cost
        self.since = 1 << 30
        self.prefill_tokens = 0

    def extra(self, shape) -> float:
        """The extra seconds of ``shape``, the next step to run (0 for a step with a prefill chunk)."""
        if shape.prefill_chunks:
            self.since, self.prefill_tokens = 0, shape.num_prefill_tokens
            return 0.0
        self.since += 1
        if self.since > self.cost.num_steps or not shape.decode_context_lens:
            return 0.0
        return self.cost(self.prefill_tokens, len(shape.decode_context_lens))[self.since - 1]
