"""Paged attention for a whole step at once: gather K/V through the block tables into padded tensors and
call one masked ``scaled_dot_product_attention`` per group of sequences (the CPU path of the engine).

A step's sequences are split into groups: decodes (one query each), bucketed by length, and the rest
(prefill chunks), so a long prefill chunk does not pad every decode to its length. A decode of ``n``
keys goes to the bucket of the next power of two at or above ``max(n, MIN_DECODE_BUCKET)``, so no
decode is padded to more than twice its length (a step whose lengths run from 20 to 2,000 would
otherwise gather and attend 2,000 keys for every sequence). Within a group of ``S`` sequences, ``Mq`` =
the longest query and ``L`` = the longest context::

    key j of sequence s:   block = block_table[s, j // block_size], offset = j % block_size  (j < seq_len)
    query i of sequence s: position seq_len - q_len + i, attends keys j <= position (and j > position - w
                           with a sliding window w)

    q   [T, Hq, D]  --scatter-->  [S, Hkv, G * Mq, D]   (G = Hq / Hkv query heads of one KV head, so GQA
    K/V [S, L, Hkv, D] (gathered, padding zeroed)         needs no repeat of K/V)
    mask bool [S, 1, G * Mq, L]

The :class:`PaddedLayout` (the index tensors and masks of every group) depends only on the step's block
tables and lengths: it is built once per step on the host (NumPy, no device reads) and shared by every
layer. Conventions are ``kernels.reference``'s (its docstring): a slot no sequence owns is never read (a
padding key re-reads its sequence's last key, which the mask then excludes, so a NaN left in a free slot
cannot reach a result; sequences with no key at all read slot 0 and are zeroed), and a query with no key
to attend gets output 0 and LSE ``-inf``, never NaN.

fp8 caches (``torch.float8_e4m3fn``) as every backend: :func:`store_kv` writes ``k / k_scale`` computed in
float32, saturated at +-448 and rounded to nearest (the Triton ``write_kv``'s rule), and the gather reads
``stored * scale`` (None: 1.0).

``paged_decode``, ``paged_prefill`` and ``write_kv`` wrap the same code with the ``kernels`` launcher
contract (validation included), so the conformance gate checks exactly what the engine runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from pagedbench.kernels.validation import (
    FP8_DTYPES,
    FP8_MAX,
    REFERENCE_DTYPES,
    KernelInputError,
    check_paged_decode,
    check_paged_prefill,
    check_write_kv,
)
from torch.nn import functional as F


@dataclass(frozen=True, slots=True)
class PaddedGroup:
    """``S`` sequences of one step padded to ``max_query_len`` queries and ``max_seq_len`` keys."""

    token_rows: torch.Tensor  # int64 [Tg]: rows of the step's T tokens owned by this group
    padded_rows: torch.Tensor  # int64 [Tg]: the same tokens' rows in the padded [S * max_query_len]
    key_slots: torch.Tensor  # int64 [S * L]: slot (block * block_size + offset) of key j, flattened; for
    # j >= seq_len the slot of key seq_len - 1
    empty_seqs: torch.Tensor | None  # int64: sequences with seq_len 0 (they read slot 0: zeroed); None if none
    mask: torch.Tensor  # bool [S, 1, max_query_len, L]: query i may attend key j
    has_empty_rows: bool  # some owned query has no key at all (seq_len 0): its output is set to 0
    all_rows_in_order: bool  # the group owns every row of q, in order, one each (a decode-only step)
    num_seqs: int
    max_query_len: int
    max_seq_len: int  # L (>= 1)


@dataclass(frozen=True, slots=True)
class PaddedLayout:
    """The groups of one step (decodes first); ``num_tokens`` = T, the rows of q."""

    groups: tuple[PaddedGroup, ...]
    num_tokens: int
    sliding_window: int | None


def build_padded_layout(block_tables: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                        block_size: int, *, query_starts: np.ndarray | None = None,
                        sliding_window: int | None = None,
                        device: torch.device | str | None = None) -> PaddedLayout:
    """The layout of a step from host arrays (nothing is read from a device).

    block_tables int [S, max_blocks] (entries past a sequence's blocks are never used, whatever they
    hold); seq_lens, query_lens int [S] (the queries are the last ``query_lens[s]`` of ``seq_lens[s]``
    tokens); query_starts int [S]: row in T of each sequence's first query (``cu_seqlens_q[:-1]``;
    None: the rows in sequence order from 0).
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    if query_starts is None:
        starts = np.concatenate(([0], np.cumsum(query_lens)[:-1])).astype(np.int64)
    else:
        starts = np.asarray(query_starts, dtype=np.int64)
    is_decode = query_lens == 1
    num_tokens = int(query_lens.sum())
    groups = []
    for members in (*_decode_buckets(np.flatnonzero(is_decode), seq_lens),
                    np.flatnonzero(~is_decode & (query_lens > 0))):
        if members.size:
            groups.append(_group(block_tables[members], seq_lens[members], query_lens[members],
                                 starts[members], block_size, sliding_window, device, num_tokens))
    return PaddedLayout(tuple(groups), num_tokens, sliding_window)


#: decodes this short or shorter share one bucket: below it a group's fixed cost (a gather and an SDPA
#: call per layer) outweighs the padding it saves
MIN_DECODE_BUCKET = 32


def _decode_buckets(decodes: np.ndarray, seq_lens: np.ndarray) -> list[np.ndarray]:
    """``decodes`` (indices into ``seq_lens``) split by the power of two at or above each length."""
    if decodes.size == 0:
        return []
    lens = np.maximum(seq_lens[decodes], MIN_DECODE_BUCKET)
    bucket = np.frexp(lens - 1)[1]  # ceil(log2(len)) for len >= 2
    if bucket.min() == bucket.max():  # the commonest step: one bucket, the members as they are
        return [decodes]
    return [decodes[bucket == b] for b in np.unique(bucket)]


def _group(tables: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray, starts: np.ndarray,
           block_size: int, sliding_window: int | None, device, num_tokens: int) -> PaddedGroup:
    num_seqs = len(seq_lens)
    max_len = max(1, int(seq_lens.max()))
    max_q = int(query_lens.max())
    key_pos = np.arange(max_len)
    key_valid = key_pos[None, :] < seq_lens[:, None]  # [S, L]
    empty = seq_lens == 0
    slots = _key_slots(tables, seq_lens, key_valid, empty, block_size, max_len)
    if max_q == 1 and sliding_window is None:  # decodes: the query is the last token and sees every key
        allowed = key_valid[:, None, :]
        has_key = ~empty[:, None]
        owned = np.ones((num_seqs, 1), dtype=bool)
    else:
        q_idx = np.arange(max_q)
        q_pos = (seq_lens - query_lens)[:, None] + q_idx[None, :]  # [S, Mq]
        owned = q_idx[None, :] < query_lens[:, None]
        allowed = (key_pos[None, None, :] <= q_pos[:, :, None]) & key_valid[:, None, :]
        if sliding_window is not None:
            allowed &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        has_key = allowed.any(axis=-1)
        # padding query rows attend every real key (their output is dropped; this keeps them NaN-free)
        allowed = np.where(owned[:, :, None], allowed, key_valid[:, None, :])
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    i_of_token = np.arange(int(query_lens.sum())) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
    token_rows = np.repeat(starts, query_lens) + i_of_token
    as_tensor = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)  # noqa: E731
    return PaddedGroup(
        token_rows=as_tensor(token_rows, torch.int64),
        padded_rows=as_tensor(seq_of_token * max_q + i_of_token, torch.int64),
        key_slots=as_tensor(slots.reshape(-1), torch.int64),
        empty_seqs=as_tensor(np.flatnonzero(empty), torch.int64) if empty.any() else None,
        mask=as_tensor(allowed[:, None], torch.bool),
        has_empty_rows=bool((owned & ~has_key).any()),
        all_rows_in_order=max_q == 1 and np.array_equal(token_rows, np.arange(num_tokens)),
        num_seqs=num_seqs, max_query_len=max_q, max_seq_len=max_len,
    )


def _key_slots(tables: np.ndarray, seq_lens: np.ndarray, key_valid: np.ndarray, empty: np.ndarray,
               block_size: int, max_len: int) -> np.ndarray:
    """int64 [S, L]: the slot (``block * block_size + offset``) of each key.

    Padding keys re-read the sequence's last key rather than being zeroed after the gather: a masked
    fill of the gathered [S, L, Hkv, D] costs as much as the gather itself on a CPU, and the mask gives
    these duplicates weight exactly 0. Entries of a table past its sequence's blocks are never read
    (whatever they hold, the slots they give are replaced); a sequence with no key reads slot 0.
    """
    num_seqs = len(seq_lens)
    blocks_used = -(-max_len // block_size)
    if tables.shape[1] < blocks_used:
        if seq_lens.max() > 0:  # the launchers' checks name this; unchecked, it must still not read wild
            raise KernelInputError(f"block tables of {tables.shape[1]} blocks cannot hold {max_len} keys "
                                   f"of {block_size} per block")
        return np.zeros((num_seqs, max_len), dtype=np.int64)  # no sequence has a key
    # every slot of the first blocks_used blocks, block by block, then cut to L
    block_starts = tables[:, :blocks_used].astype(np.int64) * block_size
    slots = (block_starts[:, :, None] + np.arange(block_size)).reshape(num_seqs, -1)[:, :max_len]
    last = slots[np.arange(num_seqs), np.maximum(seq_lens - 1, 0)]
    last[empty] = 0
    return np.where(key_valid, slots, last[:, None])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _slot_view(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as ``[num_blocks * block_size, Hkv, D]`` (a view), or None if its layout has no such view."""
    if cache.stride(0) != cache.shape[1] * cache.stride(1):
        return None
    return cache.flatten(0, 1)  # a view: blocks and offsets merge into one stride


def _gather(cache: torch.Tensor, g: PaddedGroup, dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """[S, L, Hkv, D] in ``dtype``; a sequence with no key reads zeros (slot 0 may hold anything). An fp8
    cache's values are multiplied by ``scale`` (None: 1.0) once converted."""
    slots = _slot_view(cache)
    if slots is not None:  # index_select over slots: ~5x faster than indexing by (block, offset) on a CPU
        x = slots.index_select(0, g.key_slots).view(g.num_seqs, g.max_seq_len, *cache.shape[2:]).to(dtype)
    else:
        block_size = cache.shape[1]
        x = cache[g.key_slots // block_size, g.key_slots % block_size].view(
            g.num_seqs, g.max_seq_len, *cache.shape[2:]).to(dtype)
    if cache.dtype in FP8_DTYPES and scale is not None:
        x = x * scale
    if g.empty_seqs is not None:
        x[g.empty_seqs] = 0.0
    return x


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: PaddedGroup,
                  scale: float, want_lse: bool, kv_scales: tuple[float | None, float | None] = (None, None),
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Outputs [Tg, Hq, D] (compute dtype) and, with ``want_lse``, LSE [Tg, Hq] of the group's rows."""
    ct = _compute_dtype(q.dtype)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    s, mq, ln = g.num_seqs, g.max_query_len, g.max_seq_len
    if mq == 1:  # one query per sequence: [S, Hq, D] is already [S, Hkv, G, D], no padding to scatter
        q1 = q if g.all_rows_in_order else q[g.token_rows]
        qg = q1.to(ct).view(s, num_kv_heads, group_size, head_dim)
        mask = g.mask  # [S, 1, 1, L]: the same keys for every query head, broadcast
    else:
        q_pad = q.new_zeros((s * mq, num_heads, head_dim), dtype=ct)
        q_pad[g.padded_rows] = q[g.token_rows].to(ct)
        # [S, Mq, Hkv, G, D] -> [S, Hkv, G * Mq, D]: every query head of a KV head in one matrix
        qg = q_pad.view(s, mq, num_kv_heads, group_size, head_dim).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(s, num_kv_heads, group_size * mq, head_dim)
        mask = g.mask if group_size == 1 else g.mask.expand(s, group_size, mq, ln).reshape(
            s, 1, group_size * mq, ln)
    k = _gather(k_cache, g, ct, kv_scales[0]).transpose(1, 2)  # [S, Hkv, L, D]
    v = _gather(v_cache, g, ct, kv_scales[1]).transpose(1, 2)
    lse = None
    if want_lse:  # SDPA returns no LSE: the same masked softmax written out
        scores = (qg @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask, -math.inf)
        lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is allowed
        probs = torch.where(torch.isfinite(lse)[..., None], torch.exp(scores - lse[..., None]), 0.0)
        o = probs @ v
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    # back to [S * Mq, Hq, D], then the group's own rows
    if mq == 1:
        o = o.reshape(s, num_heads, head_dim)
        lse = None if lse is None else lse.reshape(s, num_heads)
    else:
        o = o.view(s, num_kv_heads, group_size, mq, head_dim).permute(0, 3, 1, 2, 4).reshape(
            s * mq, num_heads, head_dim)[g.padded_rows]
        if lse is not None:
            lse = lse.view(s, num_kv_heads, group_size, mq).permute(0, 3, 1, 2).reshape(
                s * mq, num_heads)[g.padded_rows]
    if g.has_empty_rows and lse is None:
        # rows with no key: the convention is 0. torch 2.13's CPU SDPA already returns 0 there, but
        # older releases return NaN: keep the guard
        owned_mask = g.mask.view(s, mq, ln).any(-1).view(-1)[g.padded_rows]
        o = torch.where(owned_mask[:, None, None], o, 0.0)
    return o, lse


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: PaddedLayout,
           scale: float, *, out: torch.Tensor | None = None, return_lse: bool = False,
           k_scale: float | None = None, v_scale: float | None = None):
    """Attention of the step's queries q [T, Hq, D] over the paged caches [num_blocks, block_size, Hkv,
    D] (K/V already written; fp8 caches read as ``stored * k_scale``, ``* v_scale``). Returns out like q
    (``out`` itself when given; rows owned by no group are left as they were) and, with ``return_lse``,
    LSE [T, Hq] (float32; float64 for float64 inputs)."""
    kv_scales = (k_scale, v_scale)
    if out is None and not return_lse and len(layout.groups) == 1 and layout.groups[0].all_rows_in_order:
        o, _ = _attend_group(q, k_cache, v_cache, layout.groups[0], scale, False, kv_scales)
        return o.to(q.dtype)  # a decode-only step: the group's output is every row, in order
    if out is None:
        out = torch.empty_like(q)
    lse = None
    if return_lse:
        lse = torch.full(q.shape[:2], -math.inf, dtype=_compute_dtype(q.dtype), device=q.device)
    for g in layout.groups:
        o, group_lse = _attend_group(q, k_cache, v_cache, g, scale, return_lse, kv_scales)
        out[g.token_rows] = o.to(q.dtype)
        if lse is not None:
            lse[g.token_rows] = group_lse.to(lse.dtype)
    return (out, lse) if return_lse else out


def quantize_fp8(x: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float32, saturated at +-FP8_MAX, rounded to the nearest value of fp8 ``dtype``
    (torch's conversion rounds to nearest even; the clamp because not every torch release saturates there:
    some give NaN past the range)."""
    x = x.to(torch.float32)
    if scale is not None:
        x = x / float(scale)
    return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, block_size: int, *, k_scale: float | None = None,
             v_scale: float | None = None) -> None:
    """k_cache[slot // block_size, slot % block_size] = k (same for v); every slot must be >= 0. fp8 caches
    receive :func:`quantize_fp8` of k and v, written as bytes (the CPU has no fp8 index_copy_)."""
    if k_cache.dtype in FP8_DTYPES:
        k = quantize_fp8(k, k_scale, k_cache.dtype).view(torch.uint8)
        v = quantize_fp8(v, v_scale, v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    slots = slot_mapping.to(torch.int64)
    k_slots, v_slots = _slot_view(k_cache), _slot_view(v_cache)
    if k_slots is not None and v_slots is not None:  # one index_copy_ per cache, no (block, offset) split
        k_slots.index_copy_(0, slots, k.to(k_cache.dtype))
        v_slots.index_copy_(0, slots, v.to(v_cache.dtype))
        return
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


# --- the kernels launcher contract, over the same code (the conformance gate's entry points) ------------
def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.int64).numpy()


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, sliding_window=None,
                 num_splits=None, out=None, return_lse=False, validate=None, k_scale=None, v_scale=None):
    """``kernels.paged_decode``'s contract (``num_splits`` is checked and ignored). Reads the block
    tables and lengths back to the host to build the layout (free on the CPU, a sync on a GPU)."""
    shape = check_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                               sliding_window=sliding_window, num_splits=num_splits, out=out,
                               validate=validate, dtypes=REFERENCE_DTYPES, fp8=True, k_scale=k_scale,
                               v_scale=v_scale)
    layout = build_padded_layout(_host(block_tables), _host(seq_lens), np.ones(shape.num_seqs, np.int64),
                                 shape.block_size, sliding_window=sliding_window, device=q.device)
    scale = 1.0 / math.sqrt(shape.head_dim) if scale is None else float(scale)
    return attend(q, k_cache, v_cache, layout, scale, out=out, return_lse=return_lse, k_scale=k_scale,
                  v_scale=v_scale)


def paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale=None,
                  sliding_window=None, out=None, return_lse=False, validate=None, k_scale=None, v_scale=None):
    """``kernels.paged_prefill``'s contract: rows owned by no sequence are left as they were in ``out``."""
    shape = check_paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale,
                                sliding_window=sliding_window, out=out, validate=validate,
                                dtypes=REFERENCE_DTYPES, fp8=True, k_scale=k_scale, v_scale=v_scale)
    cu = _host(cu_seqlens_q)
    layout = build_padded_layout(_host(block_tables), _host(seq_lens), np.diff(cu), shape.block_size,
                                 query_starts=cu[:-1], sliding_window=sliding_window, device=q.device)
    scale = 1.0 / math.sqrt(shape.head_dim) if scale is None else float(scale)
    return attend(q, k_cache, v_cache, layout, scale, out=out, return_lse=return_lse, k_scale=k_scale,
                  v_scale=v_scale)


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """``kernels.write_kv``'s contract: slot -1 skips the token; fp8 caches quantized (:func:`store_kv`)."""
    check_write_kv(k, v, k_cache, v_cache, slot_mapping, dtypes=REFERENCE_DTYPES, fp8=True, k_scale=k_scale,
                   v_scale=v_scale)
    keep = slot_mapping >= 0
    store_kv(k[keep], v[keep], k_cache, v_cache, slot_mapping[keep], k_cache.shape[1], k_scale=k_scale,
             v_scale=v_scale)
