"""``merge_attn_states`` (the Triton launcher and the torch reference) rejects bad arguments with an error
naming the argument, expected and actual, before anything is written; strided parts work."""

from __future__ import annotations

import math
import re

import pytest
import torch
from pagedbench import kernels
from pagedbench.kernels import reference
from pagedbench.kernels.validation import KernelDtypeError, KernelInputError

T, H, D = 3, 2, 8
MERGES = {"triton": kernels.merge_attn_states, "torch": reference.merge_attn_states}


def _parts(dtype=torch.float16):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(T, H, D, generator=gen).to(dtype), torch.randn(T, H, generator=gen),
            torch.randn(T, H, D, generator=gen).to(dtype), torch.randn(T, H, generator=gen))


def _with(i, value):
    args = list(_parts())
    args[i] = value
    return args


BAD = [
    ("lse_a float16", lambda: _with(1, torch.zeros(T, H, dtype=torch.float16)), KernelDtypeError,
     "lse_a must have dtype float32; got torch.float16"),
    ("lse_b wrong shape", lambda: _with(3, torch.zeros(T, H + 1)), KernelInputError,
     "lse_b: shape [num_tokens, num_heads] (out_a.shape[:2]) must be (3, 2); got (3, 3)"),
    ("out_b other dtype", lambda: _with(2, torch.zeros(T, H, D)), KernelDtypeError,
     "out_b must have the dtype of out_a (torch.float16); got torch.float32"),
    ("out_a 2-D", lambda: _with(0, torch.zeros(T, H)), KernelInputError, "out_a must be 3-D"),
    ("lse_a a list", lambda: _with(1, [[0.0] * H] * T), KernelDtypeError, "lse_a must be a torch.Tensor"),
    ("no head_dim", lambda: [torch.zeros(T, H, 0, dtype=torch.float16), torch.zeros(T, H),
                             torch.zeros(T, H, 0, dtype=torch.float16), torch.zeros(T, H)],
     KernelInputError, "out_a: head_dim (out_a.shape[2]) must be >= 1; got 0"),
]


@pytest.mark.parametrize("which", sorted(MERGES))
@pytest.mark.parametrize("name,make,error,message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise_naming_them(which, name, make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        MERGES[which](*make())


@pytest.mark.parametrize("which", sorted(MERGES))
def test_bad_out_buffers_raise_and_stay_unwritten(which):
    out_a, lse_a, out_b, lse_b = _parts()
    out = torch.full((T, H, D), math.nan, dtype=torch.float32)
    with pytest.raises(KernelDtypeError, match=re.escape("out must have dtype torch.float16")):
        MERGES[which](out_a, lse_a, out_b, lse_b, out=out)
    lse_out = torch.full((T, H + 1), math.nan)
    with pytest.raises(KernelInputError, match=re.escape("out_lse: shape [num_tokens, num_heads] must be (3, 2)")):
        MERGES[which](out_a, lse_a, out_b, lse_b, out_lse=lse_out)
    assert out.isnan().all() and lse_out.isnan().all()


def test_strided_parts_match_the_reference():
    """Parts that are views (heads of a wider buffer, a transposed LSE) are read through their strides."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(T, 2 * H, D, generator=gen)
    lse = torch.randn(H, T, generator=gen).t()  # non-contiguous [T, H]
    args = (wide[:, ::2], lse, wide[:, 1::2], torch.randn(T, H, generator=gen))
    got_out, got_lse = kernels.merge_attn_states(*args)
    want_out, want_lse = reference.merge_attn_states(*args)
    torch.testing.assert_close(got_out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)

