"""Deliberately broken implementations: the suite must fail every one of them (the mutation check).

``control`` is a small, correct pure-torch paged implementation written for this purpose, with each
step a hook: how many keys a sequence has, which logical positions are read, which physical block a
logical block maps to, which KV head a query head reads, where a slot's elements start, which tokens
``write_kv`` stores. Each ``mutant-*`` subclass overrides exactly one hook, so it is wrong in one way
only; ``mutant-no-cow`` breaks ``refengine.BlockManager``'s copy-on-write hook instead. The control
must pass the same tests (``test_mutants.py`` checks it), so a kill is the mutation's doing.

Every element access goes through flat element offsets (``slot * elements_per_slot``), as a kernel's
pointer arithmetic does, so the int32 mutant wraps where a kernel would.
"""

from __future__ import annotations

import itertools
import math

import torch
from pagedbench.conformance.adapter import Implementation, NotSupported, register
from pagedbench.conformance.capabilities import Capabilities, DispatchBoundaries


@register("control")
class ControlImplementation(Implementation):
    """Correct paged attention, cache writes and block accounting, in plain torch (float32 compute)."""

    #: which part of the suite can see this implementation's fault (a key of test_mutants.SUITES)
    breaks = "numerics"
    #: the mutation check's own: not offered to users
    listed = False
    capabilities = Capabilities(fp8_kv_cache=True, batch_invariant_dispatch=True)  # one sequence at a time

    # --- the hooks the mutants override --------------------------------------------------------------
    def _num_keys(self, seq_len: int) -> int:
        return seq_len

    def _positions(self, seq_len: int, block_size: int) -> torch.Tensor:
        return torch.arange(self._num_keys(seq_len))

    def _physical_blocks(self, table_row: torch.Tensor, logical: torch.Tensor, num_used: int) -> torch.Tensor:
        return table_row[logical].to(torch.int64)

    def _kv_heads(self, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        return torch.arange(num_heads) // (num_heads // num_kv_heads)

    def _offset_in_block(self, pos: torch.Tensor, block_size: int) -> torch.Tensor:
        return pos % block_size

    def _dequantize(self, values: torch.Tensor, key_pos: torch.Tensor, first_query: int,
                    scale: float) -> torch.Tensor:
        """fp8 cache values ``[n, H, D]`` (float32) at positions ``key_pos`` as read: times the scale.
        ``first_query``: the position of the step's first query (keys before it are the cached prefix)."""
        return values * scale

    def _slot_offsets(self, slots: torch.Tensor, elements_per_slot: int) -> torch.Tensor:
        return slots.to(torch.int64) * elements_per_slot

    def _view_offset(self, cache: torch.Tensor) -> int:
        """Where a dense cache view starts in the allocation holding it (a layer of a layer-packed cache)."""
        return cache.storage_offset()

    def _addressed(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache view as the kernel addresses it (its first element where the view starts)."""
        return cache

    def _kv_scale_pair(self, k_scale: float | None, v_scale: float | None) -> tuple[float, float]:
        """The (k, v) scales an fp8 cache is read with; None is 1.0."""
        return (1.0 if k_scale is None else k_scale), (1.0 if v_scale is None else v_scale)

    def _batch_lens(self, seq_lens: list[int]) -> list[int]:
        """The number of keys each sequence of the batch attends over (its length)."""
        return seq_lens

    def _planned(self, op: str, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """q as the call reads it (an implementation with a plan/run split reads it as its plan says)."""
        return q

    def _written(self, slots: torch.Tensor) -> torch.Tensor:
        return slots >= 0

    def _in_window(self, key_pos: torch.Tensor, q_pos: torch.Tensor, window: int) -> torch.Tensor:
        return key_pos[None, :] > q_pos[:, None] - window

    def _softmax(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities, lse) over the last dim; a row of -inf gives probabilities 0, LSE -inf."""
        lse = torch.logsumexp(scores, dim=-1)
        return torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0), lse

    def _output_buffer(self, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return torch.empty_like(q) if out is None else out

    def _merge_weights(self, lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(weight of A, weight of B, merged LSE) from natural-log LSEs; a -inf part weighs 0."""
        lse = torch.logaddexp(lse_a, lse_b)
        safe = torch.where(torch.isfinite(lse), lse, 0.0)
        w_a = torch.where(torch.isinf(lse_a), 0.0, torch.exp(lse_a - safe))
        return w_a, torch.where(torch.isinf(lse_b), 0.0, torch.exp(lse_b - safe)), lse

    # --- building blocks -----------------------------------------------------------------------------
    def _flat(self, cache: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(flat elements, where the cache starts among them): a dense cache is addressed through the whole
        allocation holding it, as a kernel given a base pointer and an offset is; another is copied flat."""
        if not cache.is_contiguous():
            return cache.reshape(-1), 0
        whole = cache.as_strided((cache.untyped_storage().nbytes() // cache.element_size(),), (1,), 0)
        return whole, self._view_offset(cache)

    def _read_slots(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """cache ``[nb, bs, H, D]`` rows at ``slots`` -> ``[n, H, D]``, through flat element offsets."""
        per_slot = cache.shape[2] * cache.shape[3]
        flat, base = self._flat(self._addressed(cache))
        index = self._slot_offsets(slots, per_slot)[:, None] + torch.arange(per_slot) + base
        return flat[index].reshape(len(slots), cache.shape[2], cache.shape[3])

    def _logical_kv(self, cache: torch.Tensor, table_row: torch.Tensor,
                    seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (or values) a sequence attends to, float32 ``[n, H, D]``, and their positions."""
        bs = cache.shape[1]
        pos = self._positions(seq_len, bs)
        blocks = self._physical_blocks(table_row, pos // bs, math.ceil(seq_len / bs))
        return self._read_slots(cache, blocks * bs + self._offset_in_block(pos, bs)).to(torch.float32), pos

    def _attend(self, q, k_cache, v_cache, table_row, seq_len, q_pos, scale, window, kv_scales=None):
        k, key_pos = self._logical_kv(k_cache, table_row, seq_len)
        v, _ = self._logical_kv(v_cache, table_row, seq_len)
        if kv_scales is not None:
            first = int(q_pos[0]) if len(q_pos) else seq_len
            k, v = (self._dequantize(k, key_pos, first, kv_scales[0]),
                    self._dequantize(v, key_pos, first, kv_scales[1]))
        heads = self._kv_heads(q.shape[1], k_cache.shape[2])
        scores = torch.einsum("qhd,khd->qhk", q.to(torch.float32), k[:, heads]) * scale
        allowed = key_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= self._in_window(key_pos, q_pos, window)
        probs, lse = self._softmax(scores.masked_fill(~allowed[:, None, :], -math.inf))
        out = torch.einsum("qhk,khd->qhd", probs, v[:, heads])
        return out, lse

    def _run(self, q, k_cache, v_cache, block_tables, seq_lens, q_lens, scale, window, out, return_lse,
             k_scale=None, v_scale=None):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        kv_scales = self._kv_scale_pair(k_scale, v_scale) if fp8 else None
        out = self._output_buffer(q, out)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        start = 0
        for s, (n, m) in enumerate(zip(self._batch_lens(seq_lens.tolist()), q_lens)):
            if m:
                o, l = self._attend(q[start : start + m], k_cache, v_cache, block_tables[s], n,
                                    torch.arange(n - m, n), scale, window, kv_scales)
                out[start : start + m], lse[start : start + m] = o.to(q.dtype), l
            start += m
        return (out, lse) if return_lse else out

    # --- the adapter interface -----------------------------------------------------------------------
    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, sliding_window=None,
                     num_splits=None, out=None, return_lse=False, k_scale=None, v_scale=None):
        q = self._planned("decode", q, k_cache, block_tables)
        return self._run(q, k_cache, v_cache, block_tables, seq_lens, [1] * q.shape[0], scale,
                         sliding_window, out, return_lse, k_scale, v_scale)

    def paged_prefill(self, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale=None,
                      sliding_window=None, out=None, return_lse=False, k_scale=None, v_scale=None):
        cu = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(cu)]
        q = self._planned("prefill", q, k_cache, block_tables)
        return self._run(q, k_cache, v_cache, block_tables, seq_lens, q_lens, scale, sliding_window, out,
                         return_lse, k_scale, v_scale)

    def merge_attn_states(self, out_a, lse_a, out_b, lse_b, *, out=None, out_lse=None):
        w_a, w_b, lse = self._merge_weights(lse_a.to(torch.float32), lse_b.to(torch.float32))
        merged = sum(torch.where(w[..., None] > 0, o.to(torch.float32), 0.0) * w[..., None]
                     for o, w in ((out_a, w_a), (out_b, w_b)))
        out = torch.empty_like(out_a) if out is None else out
        out_lse = torch.empty_like(lse) if out_lse is None else out_lse
        out.copy_(merged)
        out_lse.copy_(lse)
        return out, out_lse

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):  # flat offsets need a dense layout
            raise NotSupported("the control writes dense caches only")
        if k_cache.dtype == torch.float8_e4m3fn:  # round to nearest, saturated at +-448
            k = (k.to(torch.float64) / (k_scale or 1.0)).clamp(-448.0, 448.0).to(k_cache.dtype)
            v = (v.to(torch.float64) / (v_scale or 1.0)).clamp(-448.0, 448.0).to(v_cache.dtype)
        keep = self._written(slot_mapping)
        per_slot = k_cache.shape[2] * k_cache.shape[3]
        index = self._slot_offsets(slot_mapping[keep], per_slot)[:, None] + torch.arange(per_slot)
        for cache, x in ((k_cache, k), (v_cache, v)):
            flat, base = self._flat(cache)
            flat[index + base] = x[keep].reshape(-1, per_slot)

    def copy_blocks(self, k_cache, v_cache, pairs):
        src, dst = pairs[:, 0].to(torch.int64), pairs[:, 1].to(torch.int64)
        k_cache[dst], v_cache[dst] = k_cache[src].clone(), v_cache[src].clone()

    def block_manager(self, num_blocks, block_size, *, enable_prefix_caching=False):
        from pagedbench.refengine import BlockManager

        return BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)


class _Mutant(ControlImplementation):
    expected_to_pass = False


@register("mutant-off-by-one-length")
class OffByOneLength(_Mutant):
    """Attends to seq_len - 1 keys: the newest token is never seen."""

    def _num_keys(self, seq_len):
        return max(seq_len - 1, 0)


@register("mutant-drop-partial-block")
class DropPartialBlock(_Mutant):
    """Reads only the full blocks of a sequence: the partial last block is dropped."""

    def _positions(self, seq_len, block_size):
        return torch.arange(seq_len // block_size * block_size)


@register("mutant-read-next-block")
class ReadNextBlock(_Mutant):
    """Reads the sequence's last block from the table entry after it (past the sequence's length)."""

    def _physical_blocks(self, table_row, logical, num_used):
        shifted = torch.where(logical == num_used - 1, logical + 1, logical).clamp_max(len(table_row) - 1)
        return table_row[shifted].to(torch.int64)


@register("mutant-gqa-head-mapping")
class WrongGqaMapping(_Mutant):
    """Query head h reads KV head h % num_kv_heads instead of h // group (right only for MHA and MQA)."""

    def _kv_heads(self, num_heads, num_kv_heads):
        return torch.arange(num_heads) % num_kv_heads


@register("mutant-gqa-group-past-8")
class GqaGroupPast8(_Mutant):
    """Groups larger than 8 are tiled in 8 heads and tile t reads KV head t (mod num_kv_heads): right for
    every group up to 8, wrong for 12 and 16."""

    breaks = "merge_and_shapes"

    def _kv_heads(self, num_heads, num_kv_heads):
        group = num_heads // num_kv_heads
        if group <= 8:
            return torch.arange(num_heads) // group
        return (torch.arange(num_heads) // 8) % num_kv_heads


@register("mutant-8-bit-block-offset")
class EightBitBlockOffset(_Mutant):
    """Keeps a token's offset in its block in 8 bits: right for blocks of up to 256 tokens, wrong in the
    second half of every block of 512."""

    breaks = "merge_and_shapes"

    def _offset_in_block(self, pos, block_size):
        return (pos % block_size) & 0xFF


@register("mutant-fp8-prefix-unscaled")
class Fp8PrefixUnscaled(_Mutant):
    """Reads the cached prefix of an fp8 cache without its scale (the tokens of the step itself get it): a
    first prompt is right, every step that reads a prefix written before it is not."""

    breaks = "merge_and_shapes"

    def _dequantize(self, values, key_pos, first_query, scale):
        return torch.where((key_pos < first_query)[:, None, None], values, values * scale)


@register("mutant-past-declared-batch-switch")
class PastDeclaredBatchSwitch(_Mutant):
    """Declares that its decode switches path at 5 sequences, and the path it takes from there drops each
    sequence's newest key: right for every batch of up to 4."""

    breaks = "merge_and_shapes"
    capabilities = Capabilities(fp8_kv_cache=True, batch_invariant_dispatch=True,
                                dispatch_boundaries=DispatchBoundaries(decode_batch_sizes=(5,)))

    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, **kwargs):
        self._large = len(seq_lens) >= 5
        try:
            return super().paged_decode(q, k_cache, v_cache, block_tables, seq_lens, **kwargs)
        finally:
            self._large = False

    def _num_keys(self, seq_len):
        return max(seq_len - 1, 0) if getattr(self, "_large", False) else seq_len


@register("mutant-batch-dependent-dispatch")
class BatchDependentDispatch(_Mutant):
    """Takes a split path for batches of 3 or more sequences (the softmax's LSE merged from two halves of
    the keys), as a launcher choosing split-K by occupancy does: right everywhere, but a sequence's rows
    change in their last bits with its neighbours, though it declares that they do not."""

    breaks = "merge_and_shapes"

    def _run(self, q, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs):
        self._split = len(seq_lens) >= 3
        return super()._run(q, k_cache, v_cache, block_tables, seq_lens, *args, **kwargs)

    def _softmax(self, scores):
        n = scores.shape[-1]
        if not getattr(self, "_split", False) or n < 2:
            return super()._softmax(scores)
        lse = torch.logaddexp(torch.logsumexp(scores[..., : n // 2], dim=-1),
                              torch.logsumexp(scores[..., n // 2 :], dim=-1))
        return torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0), lse


@register("mutant-one-copy-per-source")
class OneCopyPerSource(_Mutant):
    """copy_blocks keys its pairs by source block (a ``{src: dst}`` map, where vLLM's old interface took
    ``{src: [dst, ...]}``): right while every pair has its own source, wrong when the children of an
    ``n > 1`` request copy the one last block they share in the same step, as the engine's copy-on-write
    does; all but one child then read a block nobody wrote."""

    breaks = "engine_metadata"

    def copy_blocks(self, k_cache, v_cache, pairs):
        by_source = dict(pairs.tolist())  # a later pair of a source replaces an earlier one
        kept = torch.tensor(list(by_source.items()), dtype=torch.int64).reshape(-1, 2)
        super().copy_blocks(k_cache, v_cache, kept)


@register("mutant-swapped-blocks")
class SwappedBlocks(_Mutant):
    """Logical blocks 0 and 1 read each other's physical block."""

    def _physical_blocks(self, table_row, logical, num_used):
        if num_used < 2:
            return table_row[logical].to(torch.int64)
        swapped = torch.where(logical == 0, 1, torch.where(logical == 1, 0, logical))
        return table_row[swapped].to(torch.int64)


@register("mutant-write-kv-skips-slot-0")
class WriteKvSkipsSlotZero(_Mutant):
    """write_kv treats slot 0 like the padding slot -1 and skips it."""

    def _written(self, slots):
        return slots > 0


@register("mutant-int32-offset")
class Int32Offset(_Mutant):
    """Element offsets computed in int32: they wrap past 2^31 elements (vLLM #1486)."""

    def _slot_offsets(self, slots, elements_per_slot):
        return slots.to(torch.int32) * torch.tensor(elements_per_slot, dtype=torch.int32)


@register("mutant-window-off-by-one")
class WindowOffByOne(_Mutant):
    """A sliding window of w keeps w + 1 keys ([p - w, p] instead of (p - w, p])."""

    def _in_window(self, key_pos, q_pos, window):
        return key_pos[None, :] >= q_pos[:, None] - window


@register("mutant-nan-masked-row")
class NanOnMaskedRow(_Mutant):
    """A plain softmax: a row with no key (seq_len 0) gives NaN (FlashInfer #4267-style)."""

    def _softmax(self, scores):
        lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse[..., None]), lse


@register("mutant-ignores-out")
class IgnoresOut(_Mutant):
    """Returns a fresh tensor and never writes the caller's ``out=`` buffer."""

    def _output_buffer(self, q, out):
        return torch.empty_like(q)


@register("mutant-merge-log2")
class MergeLog2(_Mutant):
    """Reads natural-log LSEs as log2 (weights 2^(lse - max)), as an adapter of a log2 kernel that
    forgot to convert would: right only when both parts' LSEs are equal."""

    breaks = "merge_and_shapes"

    def _merge_weights(self, lse_a, lse_b):
        m = torch.maximum(lse_a, lse_b)
        safe = torch.where(torch.isfinite(m), m, 0.0)
        w_a, w_b = torch.exp2(lse_a - safe), torch.exp2(lse_b - safe)
        total = w_a + w_b
        lse = torch.where(total > 0, safe + torch.log2(total.clamp_min(1e-38)), -math.inf)
        return w_a / total.clamp_min(1e-38), w_b / total.clamp_min(1e-38), lse


@register("mutant-no-cow")
class NoCopyOnWrite(_Mutant):
    """A block manager whose copy-on-write hook does nothing: forked siblings write into the block they
    share (vLLM #1101)."""

    breaks = "block_manager"

    def block_manager(self, num_blocks, block_size, *, enable_prefix_caching=False):
        from pagedbench.refengine import BlockManager

        class NoCowBlockManager(BlockManager):
            def _copy_on_write_last_block(self, seq):
                return None

        return NoCowBlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
