"""Triton kernels that write the paged KV cache: ``write_kv`` (scatter tokens to slots) and
``copy_blocks`` (whole-block copies, for copy-on-write). Launchers: ``kernels.cache_ops``.

Cache layout (K and V alike; any strides)::

    cache[num_blocks, block_size, num_kv_heads, head_dim]      slot = block_id * block_size + offset

Every offset is computed in int64 (block ids and token indices are cast before multiplying strides),
so caches past 2^31 elements work.
"""

import triton
import triton.language as tl

#: the largest finite float8_e4m3fn value
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _to_fp8_e4m3(x, dtype):
    """float32 ``x`` rounded to the nearest float8_e4m3fn value (ties to even), saturated at +-FP8_MAX, as
    ``dtype``. The rounding is done here in float32, so the final cast only meets representable values:
    Triton's interpreter rounds fp32 -> e4m3 wrongly (7.98 becomes 4.0 there) and does not saturate."""
    x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    # normal range (|x| >= 2^-6): keep 3 of float32's 23 mantissa bits, ties to even, on the bit pattern
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9; adding 1.5 * 2^14 rounds to them (ties to even), exactly
    # on |x|, with x's sign put back after, so that a tiny negative value becomes -0.0 as in torch
    magic = 24576.0
    size = (tl.abs(x) + magic) - magic
    subnormal = tl.where(x < 0, -size, size)
    return tl.where(tl.abs(x) >= 0.015625, normal, subnormal).to(dtype)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens, num_kv_heads, head_dim, block_size, k_scale, v_scale,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d,
    stride_slot_t,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr, QUANTIZE: tl.constexpr = False,
):
    """Program (i, j): tokens [i*BLOCK_T, (i+1)*BLOCK_T) x flattened (head, dim) tile j.

    Token t goes to slot ``slot_mapping[t]``; slot < 0 (the -1 padding) is skipped, so nothing is stored.
    Without QUANTIZE the tensors are integer views and bits are copied. With QUANTIZE the caches are fp8
    and ``k / k_scale`` (``v / v_scale``) is stored, rounded and saturated by :func:`_to_fp8_e4m3`.
    """
    pid_t = tl.program_id(0)
    pid_hd = tl.program_id(1)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = t < num_tokens
    slot = tl.load(slot_ptr + t * stride_slot_t, mask=t_mask, other=-1).to(tl.int64)
    keep = t_mask & (slot >= 0)
    block = tl.where(keep, slot // block_size, 0)
    offset = tl.where(keep, slot % block_size, 0)

    hd = (pid_hd * BLOCK_HD + tl.arange(0, BLOCK_HD)).to(tl.int64)
    hd_mask = hd < num_kv_heads * head_dim
    h = hd // head_dim
    d = hd % head_dim
    mask = keep[:, None] & hd_mask[None, :]

    k = tl.load(k_ptr + t[:, None] * stride_k_t + h[None, :] * stride_k_h + d[None, :] * stride_k_d,
                mask=mask, other=0)
    v = tl.load(v_ptr + t[:, None] * stride_v_t + h[None, :] * stride_v_h + d[None, :] * stride_v_d,
                mask=mask, other=0)
    kc = (k_cache_ptr + block[:, None] * stride_kc_b + offset[:, None] * stride_kc_o
          + h[None, :] * stride_kc_h + d[None, :] * stride_kc_d)
    vc = (v_cache_ptr + block[:, None] * stride_vc_b + offset[:, None] * stride_vc_o
          + h[None, :] * stride_vc_h + d[None, :] * stride_vc_d)
    if QUANTIZE:
        k = _to_fp8_e4m3(k.to(tl.float32) / k_scale, k_cache_ptr.dtype.element_ty)
        v = _to_fp8_e4m3(v.to(tl.float32) / v_scale, v_cache_ptr.dtype.element_ty)
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr, v_cache_ptr, pairs_ptr,
    block_size, num_kv_heads, head_dim,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d,
    stride_pairs_n, stride_pairs_c,
    BLOCK: tl.constexpr,
):
    """Program (p, j): the j-th BLOCK-element chunk of block ``pairs[p, 0]`` onto block ``pairs[p, 1]``.

    A block's elements are enumerated as (offset, head, dim) in row-major order, whatever the strides.
    """
    pid_pair = tl.program_id(0).to(tl.int64)
    pid_chunk = tl.program_id(1)
    src = tl.load(pairs_ptr + pid_pair * stride_pairs_n).to(tl.int64)
    dst = tl.load(pairs_ptr + pid_pair * stride_pairs_n + stride_pairs_c).to(tl.int64)

    idx = (pid_chunk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = idx < block_size * num_kv_heads * head_dim
    o = idx // (num_kv_heads * head_dim)
    h = (idx // head_dim) % num_kv_heads
    d = idx % head_dim

    k_rel = o * stride_kc_o + h * stride_kc_h + d * stride_kc_d
    v_rel = o * stride_vc_o + h * stride_vc_h + d * stride_vc_d
    k = tl.load(k_cache_ptr + src * stride_kc_b + k_rel, mask=mask)
    v = tl.load(v_cache_ptr + src * stride_vc_b + v_rel, mask=mask)
    tl.store(k_cache_ptr + dst * stride_kc_b + k_rel, k, mask=mask)
    tl.store(v_cache_ptr + dst * stride_vc_b + v_rel, v, mask=mask)
