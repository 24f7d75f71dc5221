"""Launcher of the attention-state merge kernel (``kernels.merge_kernels``): validate -> derive sizes ->
allocate or check ``out=`` / ``out_lse=`` -> launch. The formula and its conventions are in the kernel
module's docstring and in ``kernels.reference.merge_attn_states``."""

from __future__ import annotations

import torch
import triton
from pagedbench.kernels import device
from pagedbench.kernels.merge_kernels import _merge_attn_states_kernel
from pagedbench.kernels.validation import check_merge_attn_states


def merge_tiles(head_dim: int, interpret: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): all of head_dim per row; many rows a program under the interpreter (each
    program step costs milliseconds there), a register-sized tile of 4K elements on a GPU."""
    block_d = triton.next_power_of_2(head_dim)
    budget = 1 << 16 if interpret else 1 << 12
    return max(1, budget // block_d), block_d


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *,
                      out: torch.Tensor | None = None, out_lse: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention results of the same queries over disjoint key sets into the result over both.

    out_a, out_b ``[num_tokens, num_heads, head_dim]`` float32/float16/bfloat16 (one dtype, any strides);
    lse_a, lse_b float32 ``[num_tokens, num_heads]``: natural-log log-sum-exp of each part's scaled scores
    (the LSE ``paged_decode`` / ``paged_prefill`` return); ``-inf`` marks a part with no key, whose output
    is then never read. LSEs must be finite or ``-inf``. Returns (out like out_a, lse float32); both
    parts empty give 0 and ``-inf``. ``out`` / ``out_lse`` may be out_a / lse_a themselves (in place).
    """
    check_merge_attn_states(out_a, lse_a, out_b, lse_b, out=out, out_lse=out_lse)
    num_tokens, num_heads, head_dim = out_a.shape
    if out is None:
        out = torch.empty_like(out_a)
    if out_lse is None:
        out_lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=out_a.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out, out_lse
    block_r, block_d = merge_tiles(head_dim, device.backend().triton_interpret)
    _merge_attn_states_kernel[(triton.cdiv(num_rows, block_r),)](
        out_a, lse_a, out_b, lse_b, out, out_lse,
        num_rows, num_heads, head_dim,
        *out_a.stride(), *lse_a.stride(), *out_b.stride(), *lse_b.stride(), *out.stride(), *out_lse.stride(),
        BLOCK_R=block_r, BLOCK_D=block_d,
    )
    return out, out_lse
