"""Pure-torch references of every launcher, with the launchers' exact signatures.

Simple and obviously right rather than fast: each sequence's *logical* K/V is gathered through its block
table (``block = block_table[pos // block_size]``, ``offset = pos % block_size``, only for ``pos <
seq_len``), attention is computed in float32 (float64 when given float64) and cast back to q's dtype.
This module never imports the Triton kernels; it is also the CPU attention backend of the engine.

Conventions shared with the Triton launchers (``kernels.attention``):

* GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
* ``scale`` defaults to ``1 / sqrt(head_dim)``; scores are ``scale * q . k``.
* The queries of sequence ``s`` sit at positions ``seq_len - q_len .. seq_len - 1`` (decode: the last
  position). A query at position ``p`` attends keys ``j`` with ``j <= p`` (causal) and, with
  ``sliding_window=w``, ``j > p - w`` -- the window is the ``w`` most recent keys including itself.
* LSE is the natural-log log-sum-exp of the scaled scores (float32; float64 for float64 inputs).
* A query with no key to attend (``seq_len == 0``, or a position < 0 when ``q_len > seq_len`` and
  validation is off) gets output 0 and LSE ``-inf``, never NaN.
* K/V slots outside a sequence and block-table entries past its length are never read.
* fp8 caches (``torch.float8_e4m3fn``): ``write_kv`` stores ``k / k_scale`` (``v / v_scale``) rounded to
  nearest and saturated at +-448; attention reads ``stored * k_scale`` (``* v_scale``); None is 1.0.
* ``merge_attn_states`` combines two parts by their natural-log LSEs; a part with LSE ``-inf`` is not read.
"""

from __future__ import annotations

import itertools
import math

import torch
from pagedbench.kernels.validation import (
    FP8_DTYPES,
    FP8_MAX,
    REFERENCE_DTYPES,
    check_batch_invariant,
    check_contiguous_decode,
    check_copy_blocks,
    check_merge_attn_states,
    check_paged_decode,
    check_paged_prefill,
    check_write_kv,
)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_logical(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence: ``[seq_len, num_kv_heads, head_dim]``.

    ``cache`` is ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``block_table`` is the sequence's
    row ``[max_blocks]``. Only the table entries covering ``seq_len`` tokens are read.
    """
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table[pos // block_size].long()
    return cache[blocks, pos % block_size]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
           sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one sequence, in q's dtype (the caller picks float32 or float64).

    q ``[n, num_heads, d]``; k, v ``[seq_len, num_kv_heads, d]``; q_pos int ``[n]`` (positions of the
    queries). Returns out ``[n, num_heads, d]`` and lse ``[n, num_heads]``.
    """
    n, num_heads, d = q.shape
    num_kv_heads = k.shape[1]
    qg = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, d)  # head h -> kv head h // group
    scores = torch.einsum("nhgd,lhd->nhgl", qg, k) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)
    allowed = key_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= key_pos[None, :] > q_pos[:, None] - sliding_window
    scores = scores.masked_fill(~allowed[:, None, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is allowed
    # Renormalised by their sum: for scores ~1e9 the float32 lse cannot hold log(n) (its ulp is 64 or
    # more), so exp(scores - lse) alone sums to the number of tied keys instead of 1.
    weights = torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0)
    total = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(total > 0, total, 1.0)
    out = torch.einsum("nhgl,lhd->nhgd", probs, v)
    return out.reshape(n, num_heads, d), lse.reshape(n, num_heads)


def _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, q_starts: list[int], q_lens: list[int],
                     *, scale, sliding_window, out, return_lse, k_scale=None, v_scale=None):
    """Shared by decode and prefill: sequence s owns query rows ``q_starts[s] : q_starts[s] + q_lens[s]``."""
    ct = _compute_dtype(q.dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=_lse_dtype(q.dtype), device=q.device)
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, n = q_starts[s], q_lens[s]
        if n <= 0:
            continue
        k = gather_logical(k_cache, block_tables[s], max(seq_len, 0)).to(ct) * _read_scale(k_cache, k_scale)
        v = gather_logical(v_cache, block_tables[s], max(seq_len, 0)).to(ct) * _read_scale(v_cache, v_scale)
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        o, l = attend(q[start:start + n].to(ct), k, v, q_pos, scale, sliding_window)
        out[start:start + n] = o.to(q.dtype)
        lse[start:start + n] = l.to(lse.dtype)
    return (out, lse) if return_lse else out


def _read_scale(cache: torch.Tensor, scale: float | None) -> float:
    """What a cache's stored values are multiplied by when read: its scale for fp8 caches, else 1."""
    return 1.0 if cache.dtype not in FP8_DTYPES or scale is None else float(scale)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, sliding_window=None,
                 num_splits=None, out=None, return_lse=False, validate=None, k_scale=None, v_scale=None,
                 batch_invariant=False):
    """One query per sequence at its last position.

    q ``[num_seqs, num_heads, head_dim]``; k_cache, v_cache ``[num_blocks, block_size, num_kv_heads,
    head_dim]``; block_tables int32 ``[num_seqs, max_blocks]``; seq_lens int32 ``[num_seqs]``.
    Returns out ``[num_seqs, num_heads, head_dim]`` (q's dtype), and with ``return_lse`` also lse
    ``[num_seqs, num_heads]``. ``num_splits`` is checked and ignored (the reference does not split).
    fp8 caches (``torch.float8_e4m3fn``) are read as ``k_cache * k_scale``, ``v_cache * v_scale``.
    ``batch_invariant`` is checked; the reference is invariant either way (one sequence at a time).
    """
    check_batch_invariant(batch_invariant, num_splits)
    check_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                       sliding_window=sliding_window, num_splits=num_splits, out=out, validate=validate,
                       dtypes=REFERENCE_DTYPES, fp8=True, k_scale=k_scale, v_scale=v_scale)
    num_seqs = q.shape[0]
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, list(range(num_seqs)),
                            [1] * num_seqs, scale=scale, sliding_window=sliding_window, out=out,
                            return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)


def paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale=None,
                  sliding_window=None, out=None, return_lse=False, validate=None, k_scale=None, v_scale=None,
                  batch_invariant=False):
    """Causal attention of each sequence's last ``q_len`` tokens over its cached K/V.

    q ``[total_q_tokens, num_heads, head_dim]``; cu_seqlens_q int32 ``[num_seqs + 1]``: sequence s owns
    rows ``cu_seqlens_q[s] : cu_seqlens_q[s+1]``. Returns out like q, and with ``return_lse`` also lse
    ``[total_q_tokens, num_heads]``. Rows of q not owned by any sequence are left as they were in
    ``out`` (uninitialised when ``out`` is None). ``batch_invariant`` as :func:`paged_decode`.
    """
    check_batch_invariant(batch_invariant)
    check_paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale,
                        sliding_window=sliding_window, out=out, validate=validate, dtypes=REFERENCE_DTYPES,
                        fp8=True, k_scale=k_scale, v_scale=v_scale)
    cu = cu_seqlens_q.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(cu)]
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu[:-1], q_lens, scale=scale,
                            sliding_window=sliding_window, out=out, return_lse=return_lse, k_scale=k_scale,
                            v_scale=v_scale)


def contiguous_decode(q, k, v, seq_lens, *, scale=None, out=None, validate=None):
    """Decode over contiguous K/V: k, v ``[num_seqs, max_len, num_kv_heads, head_dim]``, sequence s using
    its first ``seq_lens[s]`` rows. q, out ``[num_seqs, num_heads, head_dim]``."""
    check_contiguous_decode(q, k, v, seq_lens, scale=scale, out=out, validate=validate,
                            dtypes=REFERENCE_DTYPES)
    ct = _compute_dtype(q.dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if out is None:
        out = torch.empty_like(q)
    for s, seq_len in enumerate(seq_lens.tolist()):
        seq_len = max(seq_len, 0)
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        o, _ = attend(q[s:s + 1].to(ct), k[s, :seq_len].to(ct), v[s, :seq_len].to(ct), q_pos, scale, None)
        out[s] = o[0].to(q.dtype)
    return out


def quantize_fp8(x: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float64, saturated at +-FP8_MAX, rounded to the nearest fp8 value of ``dtype``."""
    return (x.to(torch.float64) / (1.0 if scale is None else float(scale))).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, validate=None, k_scale=None, v_scale=None):
    """Store token i's k[i], v[i] (``[num_tokens, num_kv_heads, head_dim]``) at slot ``slot_mapping[i]``
    (``block = slot // block_size``, ``offset = slot % block_size``); slot -1 skips the token.
    fp8 caches receive :func:`quantize_fp8` of ``k / k_scale`` and ``v / v_scale``."""
    check_write_kv(k, v, k_cache, v_cache, slot_mapping, validate=validate, dtypes=REFERENCE_DTYPES, fp8=True,
                   k_scale=k_scale, v_scale=v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    k_new, v_new = k[keep], v[keep]
    if k_cache.dtype in FP8_DTYPES:
        k_new, v_new = quantize_fp8(k_new, k_scale, k_cache.dtype), quantize_fp8(v_new, v_scale, v_cache.dtype)
    k_cache[slots // block_size, slots % block_size] = k_new
    v_cache[slots // block_size, slots % block_size] = v_new


def copy_blocks(k_cache, v_cache, pairs, *, validate=None):
    """For every (src, dst) row of ``pairs`` (int ``[num_pairs, 2]``) copy block src onto block dst, in
    both caches. All sources are read before any destination is written."""
    check_copy_blocks(k_cache, v_cache, pairs, validate=validate, dtypes=REFERENCE_DTYPES)
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def merge_attn_states(out_a, lse_a, out_b, lse_b, *, out=None, out_lse=None):
    """The attention over key sets A and B from the attentions over each (cascade attention's merge).

    out_a, out_b ``[num_tokens, num_heads, head_dim]``; lse_a, lse_b ``[num_tokens, num_heads]``, the
    natural-log LSEs (float32; float64 beside float64 outputs), ``-inf`` for a part with no key::

        lse = logaddexp(lse_a, lse_b)      out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

    A part with LSE ``-inf`` is not read (its output may be NaN); both ``-inf`` give 0 and ``-inf``.
    Computed in float32 (float64 for float64). Returns (out like out_a, lse).
    """
    check_merge_attn_states(out_a, lse_a, out_b, lse_b, out=out, out_lse=out_lse, dtypes=REFERENCE_DTYPES)
    ct = _compute_dtype(out_a.dtype)
    la, lb = lse_a.to(ct), lse_b.to(ct)
    lse = torch.logaddexp(la, lb)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, 0.0)
    w_a = torch.where(finite & (la > -math.inf), torch.exp(la - safe), 0.0)[..., None]
    w_b = torch.where(finite & (lb > -math.inf), torch.exp(lb - safe), 0.0)[..., None]
    merged = (torch.where(w_a > 0, out_a.to(ct), 0.0) * w_a + torch.where(w_b > 0, out_b.to(ct), 0.0) * w_b)
    if out is None:
        out = torch.empty_like(out_a)
    if out_lse is None:
        out_lse = torch.empty(lse_a.shape, dtype=_lse_dtype(out_a.dtype), device=out_a.device)
    out.copy_(merged.to(out.dtype))
    out_lse.copy_(lse.to(out_lse.dtype))
    return out, out_lse
