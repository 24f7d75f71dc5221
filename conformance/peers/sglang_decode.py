"""SGLang's Triton decode attention (``sglang/kernels/ops/attention/decode_attention.py``).

``decode_attention_fwd`` reads a token-indexed KV pool, ``k_buffer[token, kv_head, :]``, through CSR
indices: the tokens of sequence s are ``kv_indices[kv_indptr[s]:kv_indptr[s + 1]]``. Our cache is that
pool seen as ``k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)`` (a token's row is its
slot), so nothing is copied; the indices are the slots of each sequence's positions, from its block
table::

    kv_indices = [table[s][p // block_size] * block_size + p % block_size for s, p in ...]

as SGLang's ``TritonAttnBackend`` builds them from ``req_to_token``. A cache whose block stride is not
``block_size`` token rows (a strided view) is no token pool: the kernel addresses a token by one row
stride (its ``page_size`` mode too: page stride = ``page_size`` x row stride), so such a cache is "not
supported" here, as are a query or an output whose last dim is strided: the kernel takes token and
head strides for them but addresses their dims as one run (``+ offs_d``). A sliding window of W keys keeps
the last ``min(seq_len, W)`` positions, as that backend's ``update_sliding_window_buffer`` does.
``num_splits`` is SGLang's per-sequence ``num_kv_splits`` (default 8, its
``triton_attention_num_kv_splits``); the split outputs go to float32 scratch buffers
``[num_seqs, num_heads, splits, head_dim]`` as in the backend. No LSE is returned. ``k_scale`` and
``v_scale`` are 1.0, as that backend passes them for an unquantized cache; ``page_size`` is left at 1
(the indices are token slots, as above).

Its dispatch rules off AMD (``decode_attention_fwd`` in that file, SGLang 0.5.23; the Lean kernel is
ROCm only), declared as ``dispatch_boundaries.gqa_groups``: ``kv_group_num == 1`` runs the MHA kernel
(``decode_attention_fwd_normal``), a larger group the grouped one (``decode_attention_fwd_grouped``),
whose head tiles hold ``min(_GROUPED_BLOCK_H, kv_group_num)`` heads of one KV head
(``_grouped_head_tiles``, ``VALID_BLOCK_H``; ``_GROUPED_BLOCK_H = 16``): from a group of 17 one KV head's
queries span two tiles. The split count is the caller's (``num_kv_splits``), not a rule of the kernel.
"""

from __future__ import annotations

import torch
from pagedbench.conformance.adapter import Capabilities, DispatchBoundaries, NotSupported, register
from pagedbench.conformance.peers import (
    PeerImplementation,
    default_scale,
    host_lengths,
    load_kernel_module,
    refuse_lse,
    refuse_unread_strides,
)

KERNEL_MODULE = "sglang.kernels.ops.attention.decode_attention"
DEFAULT_KV_SPLITS = 8


def load():
    # decode_attention.py asks sglang.srt.utils (whose package pulls in the server) only what GPU this is;
    # sglang.srt.environ (its environment switches) imports only the standard library, so it is the real one
    not_amd = {
        "is_hip": lambda: False,
        "is_gfx95_supported": lambda: False,
        "is_gfx1250_supported": lambda: False,
        "get_device_core_count": _device_core_count,
    }
    return load_kernel_module(KERNEL_MODULE, {"sglang.srt.utils": not_amd})


def _device_core_count(device_index: int = 0) -> int:
    """SGLang's ``get_device_core_count``: the GPU's multiprocessors (0 without one, as SGLang's answers)."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def token_indices(
    block_tables: torch.Tensor, lens: list[int], block_size: int, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr int32 ``[num_seqs + 1]``, kv_indices int64): each sequence's slots in position order."""
    tables = block_tables.cpu().to(torch.int64)
    parts, indptr = [], [0]
    for s, n in enumerate(lens):
        first = 0 if sliding_window is None else n - min(n, sliding_window)
        pos = torch.arange(first, n, dtype=torch.int64)
        parts.append(tables[s, pos // block_size] * block_size + pos % block_size)
        indptr.append(indptr[-1] + n - first)
    indices = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return torch.tensor(indptr, dtype=torch.int32), indices


@register("sglang-decode")
class SglangDecodeAttention(PeerImplementation):
    """SGLang decode_attention_fwd (Triton): sglang/kernels/ops/attention/decode_attention.py"""

    distribution = "sglang"
    # first group of the grouped kernel; first group whose queries span two head tiles (module docstring)
    capabilities = Capabilities(returns_lse=False, dispatch_boundaries=DispatchBoundaries(gqa_groups=(2, 17)))

    def __init__(self) -> None:
        super().__init__()
        self._kernel = load().decode_attention_fwd

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
    ):
        refuse_lse(self.name, return_lse)
        refuse_unread_strides(self.name, 1, "cur_batch * stride_qbs + cur_head * stride_qh + offs_d", q=q)
        if out is not None:
            refuse_unread_strides(self.name, 1, "cur_batch * stride_obs + cur_head * stride_oh + offs_d", out=out)
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        for cache in (k_cache, v_cache):
            if cache.stride(0) != block_size * cache.stride(1) or cache.stride(3) != 1:
                raise NotSupported(
                    f"sglang-decode reads a token pool with one row stride: a cache with strides {cache.stride()} "
                    f"is not {num_blocks * block_size} rows of one stride"
                )
        indptr, indices = token_indices(block_tables, host_lengths(seq_lens), block_size, sliding_window)
        splits = DEFAULT_KV_SPLITS if num_splits is None else num_splits
        num_seqs, num_heads = q.shape[:2]
        dev = q.device
        out = torch.empty_like(q) if out is None else out
        logits = torch.empty(num_seqs, num_heads, splits, v_cache.shape[-1], dtype=torch.float32, device=dev)
        lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=dev)
        self._kernel(
            q,
            k_cache.view(num_blocks * block_size, num_kv_heads, head_dim),
            v_cache.view(num_blocks * block_size, num_kv_heads, v_cache.shape[-1]),
            out,
            indptr.to(dev),
            indices.to(dev),
            logits,
            lse,
            torch.full((num_seqs,), splits, dtype=torch.int32, device=dev),
            splits,
            default_scale(q, scale),
            1.0,
            1.0,
        )
        return out
