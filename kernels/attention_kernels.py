"""Triton attention kernels over the paged KV cache. Launchers (validation, sizes, grids): ``kernels.attention``.

Cache layout (K and V alike; any strides)::

    cache[num_blocks, block_size, num_kv_heads, head_dim]

    logical position pos of sequence s  ->  block  = block_tables[s, pos // block_size]
                                             offset = pos % block_size

Keys are visited in tiles of BLOCK_N consecutive *logical* positions and each key's (block, offset) is
computed on its own. ``BLOCK_SIZE`` (constexpr) is the block size when it is a power of two the
launchers specialise (16, 32, 64, 128: the division and modulo become shifts and masks); 0 selects the
generic path, where the runtime ``block_size`` may be any size (1, 5, 80 ...).

Safety rules every kernel follows (what the conformance suite poisons with NaN):

* the block-table entry of a key is loaded only for ``pos < seq_len`` (the table load is masked);
* K and V loads are masked with ``other=0`` and masked scores are set to ``-inf`` before ``exp``, so no
  K/V slot outside a sequence, NaN or not, reaches the output;
* the running max is replaced by 0 while it is still ``-inf``, so empty tiles, empty splits and empty
  rows give ``p = 0``, output 0 and LSE ``-inf``, never NaN;
* every offset is int64: program ids, positions and block ids are cast before multiplying strides.

Both kernels work on all query heads of one KV head at once (decode: the GQA group, BLOCK_G rows;
prefill: BLOCK_M queries x BLOCK_G heads). With USE_DOT, Q·K^T and P·V are ``tl.dot`` on the tiles in
their own dtype (fp16/bf16: tensor cores) with float32 accumulation, P cast to V's dtype; float32 tiles
use ``input_precision="ieee"`` (TF32 keeps 10 mantissa bits and would miss the float32 bound of 1e-5).
``tl.dot`` needs at least 16 rows, keys and dims, so decode pads its group to 16 rows. Without
USE_DOT (the interpreter, where ``tl.dot`` runs numpy's slow non-BLAS loop, and small decode groups) the
products are broadcast multiply + sum in float32. Softmax statistics and the output accumulator are
float32 on both paths; ``scale`` multiplies the float32 scores (never the fp16 queries, which it could
overflow).
"""

import triton
import triton.language as tl

#: the precision of every ``tl.dot``: exact float32 products for float32 tiles (ignored for fp16/bf16)
DOT_PRECISION = tl.constexpr("ieee")


@triton.jit
def _block_and_offset(pos, block_size, BLOCK_SIZE: tl.constexpr):
    """(logical block, offset in it) of positions ``pos``: by the constexpr BLOCK_SIZE when it is set
    (a power of two: shifts and masks), else by the runtime ``block_size``."""
    if BLOCK_SIZE > 0:
        return pos // BLOCK_SIZE, pos % BLOCK_SIZE
    else:
        return pos // block_size, pos % block_size


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale, v_scale, sliding_window, block_size, group_size, head_dim, num_splits,
    stride_q_s, stride_q_h, stride_q_d,
    stride_k_b, stride_k_o, stride_k_h, stride_k_d,
    stride_v_b, stride_v_o, stride_v_h, stride_v_d,
    stride_bt_s, stride_bt_b,
    stride_out_s, stride_out_h, stride_out_split, stride_out_d,
    stride_lse_s, stride_lse_h, stride_lse_split,
    PAGED: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """Program (s, kv_head, split): one split of sequence s's keys for the query heads of kv_head.

    PAGED: K/V rows are found through the block table (``stride_k_b`` steps blocks, ``stride_k_o``
    offsets in a block). Not PAGED (contiguous baseline): ``stride_k_b`` steps sequences and
    ``stride_k_o`` positions; ``block_tables_ptr`` is unused.
    The split's normalised output and its LSE go to out[s, head, split] / lse[s, head, split] (with one
    split these are the final output and LSE).
    Keys of the query at position seq_len - 1: ``max(0, seq_len - sliding_window) <= pos < seq_len``
    (``sliding_window == 0``: no window).
    """
    tl.static_assert(BLOCK_G >= 1 and BLOCK_N >= 1 and BLOCK_D >= 1)
    tl.static_assert(not USE_DOT or (BLOCK_G >= 16 and BLOCK_N >= 16 and BLOCK_D >= 16))  # tl.dot's minimum
    s = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + s)
    g = tl.arange(0, BLOCK_G)
    g_mask = g < group_size
    heads = kv_head * group_size + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + s * stride_q_s + heads[:, None] * stride_q_h + d[None, :] * stride_q_d,
                mask=q_mask, other=0.0)
    if not USE_DOT:
        q = q.to(tl.float32)

    start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    num_keys = tl.maximum(seq_len - start, 0)
    num_tiles = tl.cdiv(num_keys, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t in range(tile_lo, tile_hi):
        pos = start + t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = pos < seq_len
        if PAGED:
            logical, offset = _block_and_offset(pos, block_size, BLOCK_SIZE)
            block = tl.load(block_tables_ptr + s * stride_bt_s + logical.to(tl.int64) * stride_bt_b,
                            mask=n_mask, other=0).to(tl.int64)
            offset = offset.to(tl.int64)
            k_rows = block * stride_k_b + offset * stride_k_o
            v_rows = block * stride_v_b + offset * stride_v_o
        else:
            k_rows = s * stride_k_b + pos.to(tl.int64) * stride_k_o
            v_rows = s * stride_v_b + pos.to(tl.int64) * stride_v_o
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + k_rows[:, None] + kv_head * stride_k_h + d[None, :] * stride_k_d,
                    mask=kv_mask, other=0.0)
        if KV_FP8:  # exact in q's dtype (e4m3 has 3 mantissa bits); k_scale is folded into ``scale``
            k = k.to(q_ptr.dtype.element_ty)
        if USE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32)
        else:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
        scores = tl.where(n_mask[None, :], scores * scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + v_rows[:, None] + kv_head * stride_v_h + d[None, :] * stride_v_d,
                    mask=kv_mask, other=0.0)
        if KV_FP8:  # v_scale multiplies the output instead
            v = v.to(q_ptr.dtype.element_ty)
        if USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        else:
            # v before p: Triton's combiner rewrites sum(p[:, :, None] * v[None], 1) into a tl.dot once every
            # side is >= 16 (GQA groups above 8), in TF32 on some versions (float32 off by 4e-4 on sm_90)
            pv = tl.sum(v.to(tl.float32)[None, :, :] * p[:, :, None], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    out_ptrs = (out_ptr + s * stride_out_s + heads[:, None] * stride_out_h + split * stride_out_split
                + d[None, :] * stride_out_d)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + s * stride_lse_s + heads * stride_lse_h + split * stride_lse_split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    num_splits, head_dim,
    stride_po_s, stride_po_h, stride_po_split, stride_po_d,
    stride_pl_s, stride_pl_h, stride_pl_split,
    stride_out_s, stride_out_h, stride_out_d,
    stride_lse_s, stride_lse_h,
    BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (s, head): merge the per-split (out, lse) of one query by their LSE.

    ``out = sum_i exp(lse_i - M) out_i / sum_i exp(lse_i - M)``, ``lse = M + log(sum_i exp(lse_i - M))``,
    M the largest lse_i; empty splits (lse -inf) weigh 0, and if all are empty out is 0 and lse -inf.
    """
    s = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    sp = tl.arange(0, BLOCK_SPLITS)
    sp_mask = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim

    lse_i = tl.load(part_lse_ptr + s * stride_pl_s + head * stride_pl_h + sp * stride_pl_split,
                    mask=sp_mask, other=float("-inf"))
    m = tl.max(lse_i, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_i - m_safe)  # 0 for empty splits
    total = tl.sum(w, axis=0)
    o_i = tl.load(part_out_ptr + s * stride_po_s + head * stride_po_h + sp[:, None] * stride_po_split
                  + d[None, :] * stride_po_d, mask=sp_mask[:, None] & d_mask[None, :], other=0.0)
    has_keys = total > 0.0
    out = tl.sum(w[:, None] * o_i, axis=0) / tl.where(has_keys, total, 1.0)
    lse = tl.where(has_keys, m_safe + tl.log(tl.where(has_keys, total, 1.0)), float("-inf"))
    tl.store(out_ptr + s * stride_out_s + head * stride_out_h + d * stride_out_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)
    tl.store(lse_ptr + s * stride_lse_s + head * stride_lse_h, lse)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr, lse_ptr,
    scale, v_scale, sliding_window, block_size, group_size, head_dim,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_b, stride_k_o, stride_k_h, stride_k_d,
    stride_v_b, stride_v_o, stride_v_h, stride_v_d,
    stride_bt_s, stride_bt_b,
    stride_out_t, stride_out_h, stride_out_d,
    stride_lse_t, stride_lse_h,
    USE_DOT: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    """Program (m_tile, kv_head, s): BLOCK_M = BLOCK_R // BLOCK_G queries of sequence s x the query heads
    of kv_head.

    The tile's BLOCK_R = BLOCK_M * BLOCK_G rows are (query, head-in-group) pairs, ``row = m * BLOCK_G + g``, so
    each K/V tile is loaded once for the whole GQA group.
    Sequence s owns query rows ``cu_seqlens_q[s] : cu_seqlens_q[s+1]`` (q_len of them); query i sits
    at position ``p = seq_len - q_len + i`` and attends keys ``j <= p`` with ``j > p - sliding_window``
    (``sliding_window == 0``: no window). Tiles past q_len visit no key and store nothing.
    USE_DOT: products by ``tl.dot`` in the tiles' dtype (see the module docstring); else broadcast
    multiply + sum in float32.
    """
    BLOCK_M: tl.constexpr = BLOCK_R // BLOCK_G
    tl.static_assert(BLOCK_M >= 1 and BLOCK_M * BLOCK_G == BLOCK_R)
    tl.static_assert(not USE_DOT or (BLOCK_R >= 16 and BLOCK_N >= 16 and BLOCK_D >= 16))  # tl.dot's minimum
    m_tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2).to(tl.int64)

    q_begin = tl.load(cu_seqlens_q_ptr + s)
    q_len = tl.load(cu_seqlens_q_ptr + s + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + s)
    r = tl.arange(0, BLOCK_R)
    query = m_tile * BLOCK_M + r // BLOCK_G
    heads = kv_head * group_size + r % BLOCK_G
    r_mask = (query < q_len) & (r % BLOCK_G < group_size)
    q_pos = seq_len - q_len + query
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_mask = r_mask[:, None] & d_mask[None, :]
    tokens = (q_begin + query).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + d[None, :] * stride_q_d,
                mask=q_mask, other=0.0)
    if not USE_DOT:
        q = q.to(tl.float32)

    # Keys this tile can see: [lo, hi), hi past the tile's last real query, lo by the window.
    first_pos = seq_len - q_len + m_tile * BLOCK_M
    hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    lo = tl.where(sliding_window > 0, tl.maximum(first_pos - sliding_window + 1, 0), 0)
    hi = tl.where(m_tile * BLOCK_M < q_len, hi, lo)
    num_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for t in range(0, num_tiles):
        pos = lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        logical, offset = _block_and_offset(pos, block_size, BLOCK_SIZE)
        block = tl.load(block_tables_ptr + s * stride_bt_s + logical.to(tl.int64) * stride_bt_b,
                        mask=n_mask, other=0).to(tl.int64)
        offset = offset.to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (block * stride_k_b + offset * stride_k_o)[:, None] + kv_head * stride_k_h
                    + d[None, :] * stride_k_d, mask=kv_mask, other=0.0)
        if KV_FP8:  # exact in q's dtype (e4m3 has 3 mantissa bits); k_scale is folded into ``scale``
            k = k.to(q_ptr.dtype.element_ty)
        if USE_DOT:  # [BLOCK_R, BLOCK_N]
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32)
        else:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        scores = scores * scale
        allowed = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        allowed = allowed & ((sliding_window == 0) | (pos[None, :] > q_pos[:, None] - sliding_window))
        scores = tl.where(allowed, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (block * stride_v_b + offset * stride_v_o)[:, None] + kv_head * stride_v_h
                    + d[None, :] * stride_v_d, mask=kv_mask, other=0.0)
        if KV_FP8:  # v_scale multiplies the output instead
            v = v.to(q_ptr.dtype.element_ty)
        if USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        else:  # v before p, as in decode: no silent rewrite into a TF32 tl.dot
            pv = tl.sum(v.to(tl.float32)[None, :, :] * p[:, :, None], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * v_scale
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(out_ptr + tokens[:, None] * stride_out_t + heads[:, None] * stride_out_h
             + d[None, :] * stride_out_d, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + tokens * stride_lse_t + heads * stride_lse_h, lse, mask=r_mask)


def _prefill_config(rows: int, keys: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_R": rows, "BLOCK_N": keys}, num_warps=warps, num_stages=stages)


#: what the GPU autotuner tries for ``_prefill_kernel`` (``prune_prefill_configs`` keeps the ones that fit)
PREFILL_CONFIGS = [
    _prefill_config(16, 16, 8, 2),  # the smallest: float32 or head_dim 256 (larger tiles spill)
    _prefill_config(16, 32, 4, 2),
    _prefill_config(32, 32, 4, 2),
    _prefill_config(64, 32, 4, 2),
    _prefill_config(64, 64, 4, 2),
    _prefill_config(128, 32, 8, 2),
    _prefill_config(128, 64, 8, 2),
]


def prune_prefill_configs(configs, named_args, **kwargs):
    """The configs of PREFILL_CONFIGS that fit the call: rows hold at least one query's GQA group
    (BLOCK_R >= BLOCK_G); float32 tiles (no tensor cores, twice the bytes) and head_dim 256 only with
    the smallest tiles (one group of at least 16 rows x 16 keys)."""
    block_g, block_d = kwargs["BLOCK_G"], kwargs["BLOCK_D"]
    wide = named_args["q_ptr"].element_size() >= 4 or block_d >= 256
    kept = [c for c in configs if c.kwargs["BLOCK_R"] >= block_g
            and (not wide or c.kwargs["BLOCK_R"] * c.kwargs["BLOCK_N"] <= max(16, block_g) * 16)]
    return kept or [c for c in configs if c.kwargs["BLOCK_R"] >= block_g][:1]
