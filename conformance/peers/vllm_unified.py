"""vLLM's Triton ``unified_attention`` (``vllm/v1/attention/ops/triton_unified_attention.py``) behind the adapter.

It is the kernel of vLLM's ``TRITON_ATTN`` backend: one call for a batch of decode and prefill rows,
with our cache layout exactly (``[num_blocks, block_size, num_kv_heads, head_size]``), so nothing is
copied. The arguments are those ``TritonAttentionImpl.forward`` passes::

    unified_attention(q, k_cache, v_cache, out, cu_seqlens_q, max_seqlen_q, seqused_k=seq_lens,
                      max_seqlen_k, softmax_scale, causal=True, window_size=(W - 1, 0) or (-1, -1),
                      block_table, softcap=0, q_descale=None, k_descale, v_descale,
                      seq_threshold_3D=128 // num_kv_heads, num_par_softmax_segments=16,
                      softmax_segm_output, softmax_segm_max, softmax_segm_expsum)

with split-K scratch of a row per query token (float32), so the kernel picks its 2-D or 3-D (split-K
over 16 segments) launch from the batch's shape as it does in vLLM: a batch takes the 3-D one while
``num_seqs * cdiv(max_seqlen_q, BLOCK_Q) <= 128 // num_kv_heads`` and its longest chunk is at most
``MAX_3D_QUERY_LEN`` (8) queries. The backend sizes its scratch for 8-query chunks only when speculative
decoding asks for them (one query a row otherwise, and a batch with more query tokens than rows goes
2-D); the scratch here is always large enough, so short prefill chunks take the 3-D path, as they do
there with speculative decoding.

Its dispatch rules (``unified_attention`` in that file, vLLM 0.34), declared as
``dispatch_boundaries`` so that the gate reaches each path from both sides:

* 2-D or 3-D: ``use_3d`` is off once ``num_seqs * triton.cdiv(max_seqlen_q, BLOCK_Q) >
  seq_threshold_3D`` (128 // 2 for the gate's 2 KV heads; one Q block per decode row: the 2-D kernel
  from 65 decode rows) or ``max_seqlen_q > MAX_3D_QUERY_LEN`` (the 2-D kernel from chunks of 9);
* 3-D keys per segment: ``kernel_unified_attention`` gives each of the 16 segments
  ``tiles_per_segment = cdiv(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE)`` tiles of ``TILE_SIZE_DECODE``
  (16 keys for 16- and 32-bit queries, ``_get_tile_size``): one tile per segment up to 256 keys, two
  from 257 (and segments past the sequence's end return early);
* query-head tile: ``BLOCK_M = 16 if num_queries_per_kv <= 16 else next_power_of_2(num_queries_per_kv)``
  (``BLOCK_Q = BLOCK_M // num_queries_per_kv``): a wider tile from a GQA group of 17.

Its ROCm (gfx1100/gfx1201), Blackwell large-head and batch-invariant branches do not run here.

Declared from the backend (``TritonAttentionBackend``): float16, bfloat16 and float32; block sizes that
are multiples of 16 (``get_kv_cache_shape`` refuses others). The backend wants head sizes of 32 and more
(``validate_head_size``); the kernel pads any head size to a power of two and is judged on all of the
suite's (a head-size check here would also hide how it treats the validation cases' bad arguments).
It returns no LSE and takes no split count, and since it picks its 2-D or 3-D kernel from the batch's
size it is not claimed bit for bit batch invariant.
fp8 KV caches (float8_e4m3fn) go in as the backend passes them with ``kv_cache_dtype="fp8"``:
``kv_quant_mode=KVQuantMode.FP8_PER_TENSOR`` and the layer's ``k_scale`` / ``v_scale`` as per-(sequence, KV
head) ``k_descale`` / ``v_descale`` (``layer._k_scale.expand(descale_shape)``); the kernel reads
``stored * k_descale``, our convention; the query stays in its own dtype (no ``q_descale``).
Sequences of length 0 are judged as every implementation's are. It takes token and head strides for
the queries and the output but addresses their dims as one run (``+ offs_d``), and no stride for
``seqused_k`` and ``cu_seqlens_q`` (``tl.load(seq_lens_ptr + seq_idx)``): views strided there are refused
("not supported"; given to the kernel they are read at the wrong elements).
"""

from __future__ import annotations

import itertools

import torch
from pagedbench.conformance.adapter import Capabilities, DispatchBoundaries, NotSupported, register
from pagedbench.conformance.peers import (
    KVQuantMode,
    PeerImplementation,
    default_scale,
    host_lengths,
    load_kernel_module,
    refuse_lse,
    refuse_unread_strides,
    vllm_stand_ins,
)

KERNEL_MODULE = "vllm.v1.attention.ops.triton_unified_attention"
# TritonAttentionBackend's MIN_LAUNCH_GRID_SIZE_2D and NUM_PAR_SOFTMAX_SEGMENTS
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16
BLOCK_SIZES = frozenset(16 * k for k in range(1, 33))
# the kernel's MAX_3D_QUERY_LEN and its decode tile (_get_tile_size: 16 keys for 16- and 32-bit queries)
MAX_3D_QUERY_LEN = 8
TILE_SIZE_DECODE = 16
# where unified_attention switches (module docstring), for the dispatch family's 2 KV heads
DISPATCH = DispatchBoundaries(
    decode_batch_sizes=(MIN_LAUNCH_GRID_SIZE_2D // 2 + 1,),  # first batch of the 2-D kernel
    context_lens=(NUM_PAR_SOFTMAX_SEGMENTS * TILE_SIZE_DECODE + 1,),  # first length of 2 tiles per segment
    gqa_groups=(17,),  # first group of a BLOCK_M wider than 16
    query_lens=(MAX_3D_QUERY_LEN + 1,),  # first chunk of the 2-D kernel
)


def load():
    return load_kernel_module(KERNEL_MODULE, vllm_stand_ins())


@register("vllm-unified")
class VllmUnifiedAttention(PeerImplementation):
    """vLLM unified_attention (Triton): vllm/v1/attention/ops/triton_unified_attention.py"""

    distribution = "vllm"
    capabilities = Capabilities(
        returns_lse=False,
        block_sizes=BLOCK_SIZES,
        supports_num_splits=False,
        batch_invariant=False,
        fp8_kv_cache=True,
        dispatch_boundaries=DISPATCH,
    )

    def __init__(self) -> None:
        super().__init__()
        self._kernel = load().unified_attention

    def _run(
        self, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_q, *, scale, sliding_window, out, kv_scales
    ):
        refuse_unread_strides(
            self.name,
            1,
            "seq_lens_ptr + seq_idx, query_start_len_ptr + ...",
            seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens_q,
        )
        refuse_unread_strides(self.name, 1, "query_stride_0, query_stride_1, then + offs_d", q=q)
        lens = host_lengths(seq_lens)
        out = torch.empty_like(q) if out is None else out
        refuse_unread_strides(self.name, 1, "output_stride_0, output_stride_1, then + offs_d", out=out)
        num_kv_heads = k_cache.shape[2]
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        k_descale, v_descale = (
            torch.full((len(lens), num_kv_heads), 1.0 if s is None else s, dtype=torch.float32, device=q.device)
            for s in kv_scales
        )
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        rows, num_heads = q.shape[0], q.shape[1]
        padded = 1 << max(q.shape[-1] - 1, 0).bit_length()
        segments = NUM_PAR_SOFTMAX_SEGMENTS
        self._kernel(
            q,
            k_cache,
            v_cache,
            out,
            cu_seqlens_q,
            max_q,
            seq_lens,
            max(lens, default=0),
            default_scale(q, scale),
            True,
            window,
            block_tables,
            0.0,
            None,
            k_descale,
            v_descale,
            seq_threshold_3D=MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads,
            num_par_softmax_segments=segments,
            softmax_segm_output=torch.empty(rows, num_heads, segments, padded, dtype=torch.float32, device=q.device),
            softmax_segm_max=torch.empty(rows, num_heads, segments, dtype=torch.float32, device=q.device),
            softmax_segm_expsum=torch.empty(rows, num_heads, segments, dtype=torch.float32, device=q.device),
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE,
        )
        return out

    def paged_decode(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        *,
        scale=None,
        sliding_window=None,
        num_splits=None,
        out=None,
        return_lse=False,
        k_scale=None,
        v_scale=None,
    ):
        refuse_lse(self.name, return_lse)
        if num_splits is not None:
            raise NotSupported("vllm-unified takes no split count")
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return self._run(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            cu,
            1,
            scale=scale,
            sliding_window=sliding_window,
            out=out,
            kv_scales=(k_scale, v_scale),
        )

    def paged_prefill(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        *,
        scale=None,
        sliding_window=None,
        out=None,
        return_lse=False,
        k_scale=None,
        v_scale=None,
    ):
        refuse_lse(self.name, return_lse)
        cu = cu_seqlens_q.tolist()
        max_q = max((b - a for a, b in itertools.pairwise(cu)), default=0)
        return self._run(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            max_q,
            scale=scale,
            sliding_window=sliding_window,
            out=out,
            kv_scales=(k_scale, v_scale),
        )
