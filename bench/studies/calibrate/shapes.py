"""A timed step as the cost model sees it: the clocks a fit can target, and a step's shape as a
:class:`~pagedbench.bench.costmodel.StepBatch` (shared by the grid, its fits and the aftermath's bounds)."""

from __future__ import annotations

from pagedbench.bench.costmodel import StepBatch
from pagedbench.refengine.engine.core import StepShape

CLOCKS = ("wall", "cpu")  # which duration of a step a fit targets: step_s or cpu_s


def step_batch(shape: StepShape) -> StepBatch:
    """The cost model's view of a step: a prefill chunk's context there excludes the chunk itself."""
    return StepBatch.of(decode_context_lens=shape.decode_context_lens,
                        prefill_chunks=tuple((q, ctx - q) for q, ctx in shape.prefill_chunks))
