"""The batch-invariant mode's arithmetic: every number a request's rows get is computed in an order that
does not depend on what else is in the step, nor on how its prefill was chunked.

What moves a row's results with the batch on a CPU (measured with torch's MKL build, one thread):

* **matmuls**: MKL picks its kernel by the number of rows ``M`` (a GEMV for one row, other blockings up
  to 16), and each reduces over ``K`` in its own order, so a row's ``x @ W.T`` changes in the last bits
  with the batch size. Fix: every linear layer is called on fixed tiles of :data:`ROW_TILE` rows (the
  last padded), so every call has one shape.
* **vector loops' scalar tails**: an elementwise op (``exp``, ``cos``, ``silu``, ``rsqrt``) runs two SIMD
  vectors at a time and the last ``numel % 32`` elements through the scalar libm, which may round
  differently; which elements fall in the tail depends on the batch. Fix: the dense layers run on a
  row count padded to a multiple of :data:`ROW_TILE` (every width is even, so every tensor's size is a
  multiple of 32), and attention's per-key tensors have a multiple of :data:`KEY_TILE` keys.
* **attention**: SDPA's and BLAS's reductions over keys and head dims depend on the padded shapes of the
  group. Fix: :func:`attend_fixed_order` computes scores as a product and a sum over the head dim (no
  BLAS), takes the max over all keys (exact in any order), then adds the exponentials and the weighted
  values key tile by key tile from position 0 (the tiles past a sequence's keys add exact zeros).

Per row, RMSNorm's statistic and the residual adds depend on the row only. Tested on a CPU with one and
two torch threads. Not covered by an argument: more threads (a parallel elementwise loop splits its range
by the total size, which could move a tail) and GPUs (CUDA's reductions pick their launch by shape);
there the mode is untested. The sampler's arithmetic over ``[rows, vocab]`` is not padded: with a
vocabulary that is not a multiple of 32 a seeded draw's probabilities could differ in the last bit.
"""

from __future__ import annotations

import math

import torch
from pagedbench.refengine.model.batched_attention import PaddedGroup, PaddedLayout, _gather
from torch import nn
from torch.nn import functional as F

#: rows per matmul call, and the multiple the dense layers' row count is padded to: at least the rows at
#: which MKL's kernel choice stops changing (16) and a multiple of two AVX-512 vectors of float32 (32)
ROW_TILE = 32
#: keys per attention tile (a multiple of 32, so the exponentials of a tile never meet a scalar tail)
KEY_TILE = 32


def padded_rows(num_rows: int) -> int:
    """``num_rows`` rounded up to a multiple of :data:`ROW_TILE` (at least one tile)."""
    return max(1, -(-num_rows // ROW_TILE)) * ROW_TILE


def pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x [T, ...] -> [num_rows, ...] (num_rows >= T), the new rows zero."""
    if x.shape[0] == num_rows:
        return x
    out = x.new_zeros((num_rows, *x.shape[1:]))
    out[:x.shape[0]] = x
    return out


def linear(layer: nn.Linear, x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """``layer(x)``; invariant: x [T, in] with T a multiple of :data:`ROW_TILE`, run one tile at a time."""
    if not invariant:
        return layer(x)
    return linear_weights(x, layer.weight, layer.bias, invariant)


def linear_weights(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   invariant: bool) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; invariant: as :func:`linear`, one tile of rows at a time."""
    if not invariant:
        return F.linear(x, weight, bias)
    if x.shape[0] % ROW_TILE:
        raise ValueError(f"batch-invariant linear needs a multiple of {ROW_TILE} rows; got {x.shape[0]}")
    tiles = [F.linear(x[i:i + ROW_TILE], weight, bias) for i in range(0, x.shape[0], ROW_TILE)]
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles)


def attend_fixed_order(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: PaddedLayout,
                       scale: float) -> torch.Tensor:
    """The step's attention like ``batched_attention.attend`` (q [T, Hq, D] -> [T, Hq, D] in q's dtype),
    each query's output computed in an order fixed by its own keys (see the module docstring)."""
    out = torch.zeros_like(q)
    for g in layout.groups:
        out[g.token_rows] = _attend_group(q, k_cache, v_cache, g, scale).to(q.dtype)
    return out


def _attend_group(q, k_cache, v_cache, g: PaddedGroup, scale: float) -> torch.Tensor:
    """[Tg, Hq, D] (float32, float64 for float64) for the group's rows."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    s, mq, ln = g.num_seqs, g.max_query_len, g.max_seq_len
    num_keys = -(-ln // KEY_TILE) * KEY_TILE
    q_pad = q.new_zeros((s * mq, num_heads, head_dim), dtype=ct)
    q_pad[g.padded_rows] = q[g.token_rows].to(ct)
    qg = q_pad.view(s, mq, num_kv_heads, group_size, 1, head_dim)
    k = _pad_keys(_gather(k_cache, g, ct), num_keys)  # [S, Lk, Hkv, D]
    v = _pad_keys(_gather(v_cache, g, ct), num_keys)
    allowed = torch.zeros((s, mq, num_keys), dtype=torch.bool, device=q.device)
    allowed[:, :, :ln] = g.mask.view(s, mq, ln)
    # scores [S, Mq, Hkv, G, Lk], one key tile at a time: a product and a sum over D, no BLAS
    scores = torch.empty((s, mq, num_kv_heads, group_size, num_keys), dtype=ct, device=q.device)
    for j in range(0, num_keys, KEY_TILE):
        kt = k[:, j:j + KEY_TILE].permute(0, 2, 1, 3)[:, None, :, None]  # [S, 1, Hkv, 1, KT, D]
        scores[..., j:j + KEY_TILE] = (qg * kt).sum(-1)
    scores = (scores * scale).masked_fill(~allowed[:, :, None, None, :], -math.inf)
    peak = scores.amax(-1, keepdim=True)  # the max is exact in any order
    peak = torch.where(torch.isfinite(peak), peak, 0.0)
    probs = torch.exp(scores - peak)  # 0 where masked
    total = torch.zeros((s, mq, num_kv_heads, group_size), dtype=ct, device=q.device)
    acc = torch.zeros((s, mq, num_kv_heads, group_size, head_dim), dtype=ct, device=q.device)
    for j in range(0, num_keys, KEY_TILE):  # tile by tile from key 0: a tile of masked keys adds 0
        pt = probs[..., j:j + KEY_TILE]
        total = total + pt.sum(-1)
        vt = v[:, j:j + KEY_TILE].permute(0, 2, 1, 3)[:, None, :, None]  # [S, 1, Hkv, 1, KT, D]
        acc = acc + (pt[..., None] * vt).sum(-2)
    o = acc / torch.where(total > 0, total, 1.0)[..., None]  # a query with no key: 0
    return o.reshape(s * mq, num_heads, head_dim)[g.padded_rows]


def _pad_keys(x: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[S, L, Hkv, D] -> [S, num_keys, Hkv, D], the new keys zero (masked out by the caller)."""
    if x.shape[1] == num_keys:
        return x
    out = x.new_zeros((x.shape[0], num_keys, *x.shape[2:]))
    out[:, :x.shape[1]] = x
    return out
