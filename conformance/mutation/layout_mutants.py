"""Mutants of the bug classes of 2025-26 that each need a family of their own to be seen: an fp8 scale
dropped on one path, a plan reused across a stride change, a batch judged as if it were uniform from its
last sequences, a layer's offset into a layer-packed cache kept in 32 bits, and a tensor-parallel rank's KV
heads numbered globally.

Each overrides one hook of ``mutants.ControlImplementation`` and is right on every case the older families
build (``test_mutants`` runs each against the part of the suite in its ``breaks``; the older parts pass
against it, which is what makes the new family necessary).
"""

from __future__ import annotations

import torch
from pagedbench.conformance.adapter import register
from pagedbench.conformance.mutation.mutants import _Mutant


@register("mutant-fp8-unit-k-scale-unscaled")
class Fp8UnitKScaleUnscaled(_Mutant):
    """Takes a k_scale of 1.0 (or None) to mean "this cache has no scales" and then reads V unscaled too:
    right whenever both scales are set away from 1.0, as every older fp8 case sets them (TensorRT-LLM's
    None-vs-1.0 scales)."""

    breaks = "merge_and_shapes"

    def _kv_scale_pair(self, k_scale, v_scale):
        if k_scale is None or k_scale == 1.0:
            return 1.0, 1.0
        return super()._kv_scale_pair(k_scale, v_scale)


@register("mutant-plan-ignores-strides")
class PlanIgnoresStrides(_Mutant):
    """Plans once per (operation, q / cache / table shapes) and keeps q's strides in the plan, as a plan
    cache keyed without strides does (FlashInfer): a later call with the same shapes and another q layout
    reads q through the old strides. Right for any one layout."""

    breaks = "layouts"

    def __init__(self) -> None:
        super().__init__()
        self._plans: dict[tuple, tuple[int, ...]] = {}

    def _planned(self, op, q, k_cache, block_tables):
        key = (op, tuple(q.shape), tuple(k_cache.shape), tuple(block_tables.shape))
        strides = self._plans.setdefault(key, tuple(q.stride()))
        return q.as_strided(q.shape, strides, q.storage_offset())


@register("mutant-uniform-batch-from-last-two")
class UniformBatchFromLastTwo(_Mutant):
    """Takes a batch whose last two sequences have the same length for a uniform one (every sequence as
    long as the last: one length for the batch, as a padded, graph-captured decode uses): right whenever
    the last two lengths differ or every length is the same (the older families' batches, the engine's
    forked siblings included), wrong for a batch whose odd sequence comes first."""

    breaks = "layouts"

    def _batch_lens(self, seq_lens):
        if len(seq_lens) >= 3 and seq_lens[-1] == seq_lens[-2]:
            return [seq_lens[-1]] * len(seq_lens)
        return seq_lens


@register("mutant-layer-offset-32-bit")
class LayerOffset32Bit(_Mutant):
    """Keeps a cache view's offset into the tensor holding it in 32 bits (mod 2^32: a uint32 offset, or an
    int32 one whose wrap comes back positive): right for every tensor of up to 2^32 elements, wrong for the
    last layers of a layer-packed cache past that (vLLM's int32 layer offsets)."""

    breaks = "layouts"

    def _view_offset(self, cache):
        return int(torch.tensor(cache.storage_offset(), dtype=torch.int64) % 2**32)


@register("mutant-tp-global-kv-head")
class TpGlobalKvHead(_Mutant):
    """Numbers a cache view's KV heads globally, from the first head of each slot of the allocation (the
    model's head numbering) rather than from the view's first head: query head h reads the slot's KV head
    h // group. Right wherever a view's heads start at its slot's first head (every layout of the other
    families, every rank's own pool) and on rank 0 of a cache all ranks share; on rank r > 0 of such a
    cache, whose view starts r * Hkv/N heads into each slot, it reads rank 0's heads."""

    breaks = "tensor_parallel"

    def _addressed(self, cache):
        # some heads of a dense cache of more heads: blocks block_size slots apart, each slot whole heads,
        # more of them than the view has
        _, bs, h, d = cache.shape
        head_slice = (cache.stride(3) == 1 and cache.stride(2) == d and cache.stride(0) == bs * cache.stride(1)
                      and cache.stride(1) % d == 0 and cache.stride(1) > h * d)
        if not head_slice:
            return cache
        into_slot = cache.storage_offset() % cache.stride(1)
        return cache.as_strided(cache.shape, cache.stride(), cache.storage_offset() - into_slot)
