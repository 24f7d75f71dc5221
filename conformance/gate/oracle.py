"""The float64 oracle every attention result is checked against.

It is written independently of ``kernels.reference``: it gathers each sequence's *logical* K/V itself
(position ``p`` of sequence ``s`` lives in physical block ``block_tables[s, p // block_size]`` at offset
``p % block_size``), reads only the first ``seq_lens[s]`` positions, and computes softmax attention in
float64 with the GQA mapping ``kv_head = q_head // (num_heads // num_kv_heads)``.

Conventions (the ``kernels`` contract):

* a query at position ``p`` attends keys at positions ``j <= p`` (causal); with a sliding window ``w``
  only ``p - w < j <= p``;
* a decode query is at position ``seq_len - 1``; the ``q_len`` prefill queries of a sequence are its last
  ``q_len`` positions;
* a row with no key left gives output 0 and LSE ``-inf``; the LSE is the natural log of the sum of
  ``exp(scale * q·k)`` over the attended keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class OracleResult:
    """Exact answers: ``out`` float64 ``[num_queries, num_heads, head_dim]``, ``lse`` float64
    ``[num_queries, num_heads]``."""

    out: torch.Tensor
    lse: torch.Tensor


def gather_logical(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` logical positions of one sequence, as float64.

    cache ``[num_blocks, block_size, num_kv_heads, head_dim]``; block_table int ``[max_blocks]``.
    Returns ``[seq_len, num_kv_heads, head_dim]`` float64 on the CPU (a copy; the cache may be anywhere).
    """
    block_size = cache.shape[1]
    rows = []
    table = block_table.tolist()
    for pos in range(seq_len):
        block = table[pos // block_size]
        rows.append(cache[block, pos % block_size].to(device="cpu", dtype=torch.float64))
    if not rows:
        return torch.empty(0, cache.shape[2], cache.shape[3], dtype=torch.float64)
    return torch.stack(rows)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: list[int], scale: float,
           sliding_window: int | None) -> OracleResult:
    """Attention of a few queries of one sequence over that sequence's logical keys, in float64.

    q ``[n, num_heads, head_dim]``; k, v ``[seq_len, num_kv_heads, head_dim]`` (logical order);
    ``q_positions[i]`` is the position of query ``i``.
    """
    q = q.to(torch.float64)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    kv_head = torch.arange(num_heads) // group  # GQA: query head h reads KV head h // group
    k_h = k[:, kv_head]  # [seq_len, num_heads, d]
    v_h = v[:, kv_head]
    scores = torch.einsum("qhd,khd->qhk", q, k_h) * scale  # [n, num_heads, seq_len]
    key_pos = torch.arange(k.shape[0])
    qpos = torch.tensor(q_positions, dtype=torch.int64)[:, None]
    allowed = key_pos[None, :] <= qpos
    if sliding_window is not None:
        allowed &= key_pos[None, :] > qpos - sliding_window
    scores = scores.masked_fill(~allowed[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is allowed
    weights = torch.exp(scores - lse[..., None].clamp_min(-1e300))
    weights = torch.nan_to_num(weights, nan=0.0)  # fully masked rows: exp(-inf - -inf)
    weights = weights.masked_fill(~allowed[:, None, :], 0.0)
    out = torch.einsum("qhk,khd->qhd", weights, v_h)
    return OracleResult(out, lse)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, sliding_window=None) -> OracleResult:
    """The exact answer of ``paged_decode``: q ``[num_seqs, num_heads, head_dim]``."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    outs, lses = [], []
    for s, n in enumerate(seq_lens.tolist()):
        k = gather_logical(k_cache, block_tables[s], n)
        v = gather_logical(v_cache, block_tables[s], n)
        r = attend(q[s : s + 1], k, v, [n - 1], scale, sliding_window)
        outs.append(r.out)
        lses.append(r.lse)
    return OracleResult(torch.cat(outs), torch.cat(lses))


def prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale=None,
            sliding_window=None) -> OracleResult:
    """The exact answer of ``paged_prefill``: q ``[total_q_tokens, num_heads, head_dim]``; the queries of
    sequence ``s`` are rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, its last positions."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    cu = cu_seqlens_q.tolist()
    outs, lses = [], []
    for s, n in enumerate(seq_lens.tolist()):
        q_len = cu[s + 1] - cu[s]
        if q_len == 0:
            continue
        k = gather_logical(k_cache, block_tables[s], n)
        v = gather_logical(v_cache, block_tables[s], n)
        positions = list(range(n - q_len, n))
        r = attend(q[cu[s] : cu[s + 1]], k, v, positions, scale, sliding_window)
        outs.append(r.out)
        lses.append(r.lse)
    if not outs:
        empty = torch.empty(0, q.shape[1], dtype=torch.float64)
        return OracleResult(torch.empty(0, *q.shape[1:], dtype=torch.float64), empty)
    return OracleResult(torch.cat(outs), torch.cat(lses))
