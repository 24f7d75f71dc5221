"""vLLM's prefix-prefill kernel, ``context_attention_fwd`` (``vllm/v1/attention/ops/prefix_prefill.py``).

It is the prefill half of ``chunked_prefill_paged_decode`` (vLLM's ``ROCM_ATTN`` backend): each
sequence's queries attend to its cached context and, causally, to themselves. Called with ``k=v=None``
it reads the queries' own keys and values from the cache too (its ``KV_FROM_CACHE`` path), which is our
contract: ``paged_prefill`` finds every key, the new ones included, already written to the cache. The
cache goes in the older paged-attention layout, as permuted views of ours (``vllm_paged_decode``)::

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]    x = 16 // element size
    value_cache [num_blocks, num_kv_heads, head_size, block_size]

and the arguments are those ``chunked_prefill_paged_decode`` passes: ``kv_cache_dtype="auto"``, unit
``k_scale``/``v_scale``, ``b_loc`` = the block tables, ``b_start_loc`` = ``cu_seqlens_q``, ``b_seq_len``
= the sequences' full lengths (context + queries), ``sliding_window`` = W keys (as the kernel reads it).

Declared from the kernel: float16, bfloat16 and float32 (it switches float32 to IEEE products on Turing
only), any block size (its tiles resolve tokens against the physical block size, "tiles need not divide
the page size"), no LSE. It has no decode entry of its own (decode rows go to ``kernel_paged_attention_2d``,
the ``vllm-paged-decode`` row). It has no dispatch rule by shape: ``context_attention_fwd`` launches one
kernel with fixed tiles (``BLOCK_M = 128``, ``BLOCK_N = 64``) whatever the batch (its ALiBi kernel is
not called here), so it declares no ``dispatch_boundaries`` and that family is "not supported". It takes
strides for the queries, the output, the caches and the block table, but none for ``b_seq_len`` and
``b_start_loc`` (``tl.load(B_Seqlen + cur_batch)``), which vLLM builds as dense buffers: strided lengths
are refused ("not supported"; given to the kernel they are read at the wrong elements). Under
Triton's interpreter, caches past 2^31 elements are refused as for that row (the interpreter ignores the
kernel's ``tl.int64`` stride annotations).
"""

from __future__ import annotations

import itertools

import torch
from pagedbench.conformance.adapter import Capabilities, NotSupported, register
from pagedbench.conformance.peers import (
    PeerImplementation,
    default_scale,
    host_lengths,
    load_kernel_module,
    refuse_lse,
    refuse_unread_strides,
    vllm_stand_ins,
)
from pagedbench.conformance.peers.vllm_paged_decode import paged_attention_layout

KERNEL_MODULE = "vllm.v1.attention.ops.prefix_prefill"


def load():
    return load_kernel_module(KERNEL_MODULE, vllm_stand_ins())


@register("vllm-prefill")
class VllmPrefixPrefill(PeerImplementation):
    """vLLM context_attention_fwd (Triton prefix prefill): vllm/v1/attention/ops/prefix_prefill.py"""

    distribution = "vllm"
    capabilities = Capabilities(returns_lse=False, supports_num_splits=False)

    def __init__(self) -> None:
        super().__init__()
        self._kernel = load().context_attention_fwd

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
    ):
        refuse_lse(self.name, return_lse)
        refuse_unread_strides(
            self.name, 1, "B_Seqlen + cur_batch, B_Start_Loc + cur_batch", seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q
        )
        if self.interpreted and k_cache.numel() >= 2**31:
            raise NotSupported(
                "vllm-prefill: offsets past 2^31 elements under Triton's interpreter, which "
                "ignores the kernel's tl.int64 stride annotations (judged on a GPU only)"
            )
        out = torch.empty_like(q) if out is None else out
        key_cache, value_cache = paged_attention_layout(k_cache, v_cache)
        cu = cu_seqlens_q.tolist()
        unit = torch.ones(1, dtype=torch.float32, device=q.device)
        self._kernel(
            q=q,
            k=None,
            v=None,
            o=out,
            kv_cache_dtype="auto",
            k_cache=key_cache,
            v_cache=value_cache,
            b_loc=block_tables,
            b_start_loc=cu_seqlens_q,
            b_seq_len=seq_lens,
            max_seq_len=max(host_lengths(seq_lens), default=0),
            max_input_len=max((b - a for a, b in itertools.pairwise(cu)), default=0),
            k_scale=unit,
            v_scale=unit,
            sliding_window=sliding_window,
            sm_scale=default_scale(q, scale),
        )
        return out
