"""PyTorch's own paged FlexAttention put behind our adapter — an implementation nobody here wrote.

``torch.nn.attention.experimental._paged_attention.PagedAttention`` keeps a page table
``[batch, logical block] -> physical page`` and its inverse ``physical_to_logical``; its caches are
``[1, num_kv_heads, num_pages * page_size, head_dim]``. Our cache ``[num_blocks, block_size,
num_kv_heads, head_dim]`` is exactly that memory seen through a permuted view, so nothing is copied:

    k_flex = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).permute(1, 0, 2)[None]

Our block tables are loaded into a ``PagedAttention`` object (the entries a sequence uses; a page is a
block), a *logical* block mask (causal, sliding window, query padding) is built with
``create_block_mask`` with KV block size = our block size, and ``convert_logical_block_mask`` maps it to
physical pages (adding the ``kv_len`` bound). Attention is ``flex_attention`` with ``enable_gqa``.

On the CPU ``flex_attention`` runs eagerly (no ``torch.compile``: compiling takes ~20 s per shape here):
PyTorch's unfused path materialises the scores over *every* physical slot and masks them afterwards.
``write_kv`` goes through ``PagedAttention.assign`` (an identity page table, slot -1 rows dropped by the
adapter). ``copy_blocks`` has no FlexAttention counterpart: not supported. ``num_splits`` is a performance
hint only; it is accepted and ignored.
"""

from __future__ import annotations

import itertools
import math
import warnings

import torch
from pagedbench.conformance.adapter import Implementation, NotSupported


def _flex():
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    return PagedAttention, AuxRequest, create_block_mask, flex_attention


def _flex_view(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, H, D]`` -> ``[1, H, num_blocks * block_size, D]`` (a view). A cache whose
    blocks are not one run of slots (padded or interleaved blocks) has no such view: not supported, since a
    copy would send write_kv's tokens to the copy."""
    nb, bs, h, d = cache.shape
    try:
        merged = cache.view(nb * bs, h, d)
    except RuntimeError:
        raise NotSupported(f"flex: FlexAttention's paged cache is one run of slots, so the cache's blocks must "
                           f"lie block_size slots apart (stride(0) = block_size x stride(1)); got shape "
                           f"{tuple(cache.shape)}, strides {tuple(cache.stride())}") from None
    return merged.permute(1, 0, 2).unsqueeze(0)


#: the eager path upcasts the whole cache (every physical slot) to float32 and scores every slot
MAX_EAGER_CACHE_BYTES = 2 * 2**30


def _check_eager_size(k_cache: torch.Tensor) -> None:
    need = 2 * k_cache.numel() * 4
    if need > MAX_EAGER_CACHE_BYTES:
        raise NotSupported(
            f"flex: eager FlexAttention on the CPU materialises the whole cache in float32 "
            f"({need / 2**30:.1f} "
            f"GiB for K and V, limit {MAX_EAGER_CACHE_BYTES / 2**30:.0f} GiB)")


def _paged_flex(q4, k_cache, v_cache, block_tables, seq_lens, q_lens, *, scale, sliding_window, want_lse):
    """q4 ``[num_seqs, num_heads, max_q, head_dim]`` (row i of sequence s is its query at position
    ``seq_lens[s] - q_lens[s] + i``; rows ``>= q_lens[s]`` are padding). Returns out like q4 and lse
    ``[num_seqs, num_heads, max_q]`` (None unless ``want_lse``)."""
    _check_eager_size(k_cache)
    PagedAttention, AuxRequest, create_block_mask, flex_attention = _flex()
    num_blocks, block_size = k_cache.shape[:2]
    num_seqs, num_heads, max_q, _ = q4.shape
    device = q4.device
    pages = PagedAttention(num_blocks, block_size, num_seqs, device=str(device))
    lens = seq_lens.to(torch.int64)
    max_logical = max(1, math.ceil(int(lens.max()) / block_size)) if num_seqs else 1
    for s, n in enumerate(lens.tolist()):
        used = math.ceil(n / block_size)
        ids = block_tables[s, :used].to(torch.int64)
        pages.page_table[s, :used] = ids
        pages.physical_to_logical[s, ids] = torch.arange(used, device=device)
        pages.capacity[s] = used * block_size
    qn = q_lens.to(torch.int64).to(device)
    first = lens.to(device) - qn  # position of each sequence's first query

    def logical_mask(b, h, q_idx, kv_idx):
        pos = first[b] + q_idx
        keep = (q_idx < qn[b]) & (kv_idx <= pos)
        if sliding_window is not None:
            keep = keep & (kv_idx > pos - sliding_window)
        return keep

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        mask = create_block_mask(logical_mask, num_seqs, None, max_q, max_logical * block_size,
                                 device=str(device), BLOCK_SIZE=(128, block_size))
        physical = pages.convert_logical_block_mask(mask, kv_len=lens.to(device))
        result = flex_attention(q4, _flex_view(k_cache), _flex_view(v_cache), block_mask=physical,
                                scale=scale, enable_gqa=num_heads != k_cache.shape[2],
                                return_aux=AuxRequest(lse=True) if want_lse else None)
    # torch.compile'd flex_attention on the CPU refuses return_lse: ask for it only when needed
    return (result[0], result[1].lse) if want_lse else (result, None)


def _finish(out_rows: torch.Tensor, lse_rows: torch.Tensor | None, q: torch.Tensor, out, return_lse: bool):
    if out is None:
        out = torch.empty_like(q)
    out.copy_(out_rows.to(q.dtype))
    return (out, lse_rows.to(torch.float32)) if return_lse else out


class FlexAttentionImplementation(Implementation):
    """PyTorch's paged FlexAttention (``torch.nn.attention.experimental._paged_attention``).

    Known to fail this suite (so not in the default ``--impl`` set): with NaN in the K/V slots no
    sequence owns, every output is NaN (the eager path multiplies masked-out probabilities, 0, by every
    physical V slot); results also change bit-wise when physical blocks are permuted. With finite
    values in those slots it matches the oracle within our bounds (decode, prefill, GQA, windows, LSE,
    spikes). ``torch.compile(flex_attention)`` on the CPU (checked by hand, not wired in: 3-20 s per
    shape) refuses ``return_lse`` and still gives NaN for every sequence whose last block is partial.
    """

    expected_to_pass = False

    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, sliding_window=None,
                     num_splits=None, out=None, return_lse=False):
        ones = torch.ones_like(seq_lens)
        o, lse = _paged_flex(q.unsqueeze(2), k_cache, v_cache, block_tables, seq_lens, ones, scale=scale,
                             sliding_window=sliding_window, want_lse=return_lse)
        return _finish(o[:, :, 0], None if lse is None else lse[:, :, 0], q, out, return_lse)

    def paged_prefill(self, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale=None,
                      sliding_window=None, out=None, return_lse=False):
        cu = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(cu)]
        max_q = max([1, *q_lens])
        q4 = q.new_zeros(len(q_lens), max_q, *q.shape[1:])
        for s, n in enumerate(q_lens):
            q4[s, :n] = q[cu[s] : cu[s + 1]]
        o, lse = _paged_flex(q4.transpose(1, 2), k_cache, v_cache, block_tables, seq_lens,
                             torch.tensor(q_lens), scale=scale, sliding_window=sliding_window,
                             want_lse=return_lse)
        o = o.transpose(1, 2)  # [num_seqs, max_q, H, D]
        lse = None if lse is None else lse.transpose(1, 2)  # [num_seqs, max_q, H]
        rows = [(s, i) for s, n in enumerate(q_lens) for i in range(n)]
        seq_idx = torch.tensor([s for s, _ in rows], dtype=torch.int64)
        row_idx = torch.tensor([i for _, i in rows], dtype=torch.int64)
        return _finish(o[seq_idx, row_idx], None if lse is None else lse[seq_idx, row_idx], q, out,
                       return_lse)

    def contiguous_decode(self, q, k, v, seq_lens, *, scale=None, out=None):
        # A contiguous cache is a paged one with one block of max_len slots per sequence.
        tables = torch.arange(k.shape[0], dtype=torch.int32, device=k.device)[:, None]
        return self.paged_decode(q, k, v, tables, seq_lens, scale=scale, out=out)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        PagedAttention = _flex()[0]
        num_blocks, block_size = k_cache.shape[:2]
        keep = slot_mapping >= 0  # PagedAttention.assign has no padding slot: drop -1 rows here
        slots = slot_mapping[keep].to(torch.int64)
        if slots.numel() == 0:
            return
        pages = PagedAttention(num_blocks, block_size, 1, device=str(k_cache.device))
        pages.page_table[0] = torch.arange(num_blocks, device=k_cache.device)  # slot == logical position
        k_val = k[keep].permute(1, 0, 2).unsqueeze(0)  # [1, H, S, D]
        v_val = v[keep].permute(1, 0, 2).unsqueeze(0)
        pages.assign(torch.zeros(1, dtype=torch.int64), slots[None], k_val, v_val, _flex_view(k_cache),
                     _flex_view(v_cache))
