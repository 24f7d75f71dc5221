"""Triton kernel that merges two partial attention states (``merge_attn_states``). Launcher: ``kernels.merge``.

Two attentions of the same queries over disjoint key sets A and B (a shared prefix and a sequence's own
suffix, in cascade attention; two splits of split-K) combine exactly through their natural-log LSEs::

    m   = max(lse_a, lse_b)                     w_a = exp(lse_a - m), w_b = exp(lse_b - m)
    lse = m + log(w_a + w_b)                    out = (w_a * out_a + w_b * out_b) / (w_a + w_b)

A part whose LSE is ``-inf`` attended no key: its weight is 0 and its output is never read (it may hold
anything, NaN included). Both ``-inf`` gives output 0 and LSE ``-inf``, never NaN. The arithmetic is
float32 whatever the outputs' dtype.
"""

import triton
import triton.language as tl


@triton.jit
def _merge_attn_states_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr,
    num_rows, num_heads, head_dim,
    stride_oa_t, stride_oa_h, stride_oa_d,
    stride_la_t, stride_la_h,
    stride_ob_t, stride_ob_h, stride_ob_d,
    stride_lb_t, stride_lb_h,
    stride_o_t, stride_o_h, stride_o_d,
    stride_l_t, stride_l_h,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program i: rows [i*BLOCK_R, (i+1)*BLOCK_R) of the flattened (token, head) pairs, all of head_dim
    (BLOCK_D >= head_dim). Row r is token ``r // num_heads``, head ``r % num_heads``."""
    tl.static_assert(BLOCK_R >= 1 and BLOCK_D >= 1)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_mask = r < num_rows
    t = r // num_heads
    h = r % num_heads
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = r_mask[:, None] & (d < head_dim)[None, :]

    lse_a = tl.load(lse_a_ptr + t * stride_la_t + h * stride_la_h, mask=r_mask, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + t * stride_lb_t + h * stride_lb_h, mask=r_mask, other=float("-inf"))
    lse_a = lse_a.to(tl.float32)
    lse_b = lse_b.to(tl.float32)
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # both parts empty: exp(-inf - 0) = 0, no NaN
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    total = w_a + w_b
    empty = total == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    # A weightless part is not read at all: its output may be NaN, and 0 * NaN is NaN.
    read_a = mask & (w_a > 0.0)[:, None]
    read_b = mask & (w_b > 0.0)[:, None]
    o_a = tl.load(out_a_ptr + t[:, None] * stride_oa_t + h[:, None] * stride_oa_h + d[None, :] * stride_oa_d,
                  mask=read_a, other=0.0).to(tl.float32)
    o_b = tl.load(out_b_ptr + t[:, None] * stride_ob_t + h[:, None] * stride_ob_h + d[None, :] * stride_ob_d,
                  mask=read_b, other=0.0).to(tl.float32)
    o = (o_a * (w_a * inv)[:, None]) + (o_b * (w_b * inv)[:, None])
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    tl.store(out_ptr + t[:, None] * stride_o_t + h[:, None] * stride_o_h + d[None, :] * stride_o_d,
             o.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + t * stride_l_t + h * stride_l_h, lse, mask=r_mask)
