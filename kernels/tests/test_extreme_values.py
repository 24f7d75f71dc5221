"""fp16 inputs at the edges of the format: the right answer is the exact (float64) result cast to the
output dtype, for the kernels and for ``kernels.reference`` alike.

Scores of ~1e9 (|q|, |k| near the fp16 maximum) are exact in float32, but their float32 LSE cannot hold
``log(num_keys)`` (its ulp is 64 or more), so weights computed as ``exp(score - lse)`` sum to the number of
tied keys instead of 1; values at +-65504 must not round past the fp16 maximum; an infinite value in a
key that carries weight makes the exact result infinite.
"""

from __future__ import annotations

import pytest
import torch
from pagedbench import kernels
from pagedbench.conformance.gate import oracle
from pagedbench.kernels import reference

LAUNCHERS = {"triton": kernels, "torch": reference}
BS, HKV, HQ, D = 4, 1, 2, 16
FP16_MAX = 65504.0


def _tied_huge_scores():
    """One sequence of 7 keys, all equal to q (60000 everywhere): 7 tied scores of 60000^2 * 16 / 4."""
    gen = torch.Generator().manual_seed(5)
    q = torch.full((1, HQ, D), 60000.0, dtype=torch.float16)
    k_cache = torch.full((2, BS, HKV, D), 60000.0, dtype=torch.float16)
    v_cache = torch.randn(2, BS, HKV, D, generator=gen).to(torch.float16)
    v_cache[1, 0] = FP16_MAX  # the mean of the values stays inside fp16 but touches its maximum
    table, lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    return q, k_cache, v_cache, table, lens


def _assert_exact_cast(got: torch.Tensor, exact: torch.Tensor) -> None:
    """got equals the float64 answer cast to fp16, up to one fp16 rounding step (1e-3 relative)."""
    want = exact.to(torch.float16)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), "non-finite pattern differs"
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite], want[~finite])
    torch.testing.assert_close(got[finite].double(), want[finite].double(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_decode_of_tied_huge_scores_is_the_mean(name):
    q, k_cache, v_cache, table, lens = _tied_huge_scores()
    exact = oracle.decode(q, k_cache, v_cache, table, lens).out
    _assert_exact_cast(LAUNCHERS[name].paged_decode(q, k_cache, v_cache, table, lens), exact)


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_prefill_of_tied_huge_scores_is_the_mean(name):
    q, k_cache, v_cache, table, lens = _tied_huge_scores()
    q = q.expand(3, HQ, D).contiguous()
    cu = torch.tensor([0, 3], dtype=torch.int32)
    exact = oracle.prefill(q, k_cache, v_cache, table, lens, cu).out
    _assert_exact_cast(LAUNCHERS[name].paged_prefill(q, k_cache, v_cache, table, lens, cu), exact)


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_contiguous_decode_of_tied_huge_scores_is_the_mean(name):
    q, k_cache, v_cache, table, lens = _tied_huge_scores()
    k = k_cache[table[0].long()].reshape(1, 2 * BS, HKV, D)
    v = v_cache[table[0].long()].reshape(1, 2 * BS, HKV, D)
    exact = oracle.decode(q, k_cache, v_cache, table, lens).out
    _assert_exact_cast(LAUNCHERS[name].contiguous_decode(q, k, v, lens), exact)


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_fp16_maximum_values_stay_finite_and_inf_values_stay_inf(name):
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, HQ, D, generator=gen).to(torch.float16)
    k_cache = torch.randn(3, BS, HKV, D, generator=gen).to(torch.float16)
    v_cache = torch.full((3, BS, HKV, D), FP16_MAX, dtype=torch.float16)
    v_cache[2, 1, :, :4] = float("inf")  # sequence 1 attends it: exactly +inf in those dims
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    exact = oracle.decode(q, k_cache, v_cache, table, lens).out
    got = LAUNCHERS[name].paged_decode(q, k_cache, v_cache, table, lens)
    assert torch.isfinite(got[0]).all() and torch.isinf(got[1, :, :4]).all()
    _assert_exact_cast(got, exact)
