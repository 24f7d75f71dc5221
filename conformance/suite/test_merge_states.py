"""merge_attn_states against the float64 merge formula, and cascade (shared-prefix) attention against the
full attention: the prefix's partial attention for every query of many sequences, merged with each
sequence's own suffix, must equal attention over the whole sequence.

LSEs are natural-log (the ``kernels`` convention); an adapter for a peer that returns log2 LSEs converts
them. A part with LSE ``-inf`` holds NaN outputs and must not be read; outputs go to NaN-filled ``out=``.
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedbench.conformance.gate import builders, cascade, checks
from pagedbench.conformance.gate.cascade import CascadeCase, MergeCase


def _merge(impl, out_a, lse_a, out_b, lse_b, *, context: str):
    """Call the implementation's merge with NaN-filled ``out=`` / ``out_lse=``; returns (out, lse) checked
    to be the caller's buffers (or at least the right kind of thing)."""
    out = builders.nan_like(out_a)
    out_lse = torch.full(lse_a.shape, math.nan, dtype=torch.float32, device=lse_a.device)
    result = impl.merge_attn_states(out_a, lse_a, out_b, lse_b, out=out, out_lse=out_lse)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise AssertionError(f"{context}: merge_attn_states must return (out, lse); got {type(result).__name__}")
    return result, (out, out_lse)


def _check_merged(result, buffers, ref, dtype: torch.dtype, tol, *, context: str) -> None:
    (out, lse), (out_buf, lse_buf) = result, buffers
    checks.check_tensor(out, ref.out, dtype, rel=tol.rel, max_abs=tol.max_abs, what="out", context=context)
    checks.check_tensor(out_buf, ref.out, dtype, rel=tol.rel, max_abs=tol.max_abs, what="out_buffer",
                        context=context)
    bound = cascade.lse_bound(tol, ref.lse)
    checks.check_tensor(lse, ref.lse, torch.float32, rel=bound, max_abs=bound, what="lse", context=context)
    checks.check_tensor(lse_buf, ref.lse, torch.float32, rel=bound, max_abs=bound, what="lse_buffer",
                        context=context)


def _require_dtype(impl, dtype: torch.dtype, name: str) -> None:
    if dtype not in impl.dtypes or dtype not in impl.capabilities.dtypes:
        pytest.skip(f"not supported: {impl.name} does not claim {name}")


MERGE_CONTROL = MergeCase(num_tokens=7)
MERGE_CASES = [
    MERGE_CONTROL,
    *(MergeCase(7, dtype=d) for d in ("fp32", "bf16")),
    *(MergeCase(7, lse=k) for k in cascade.LSE_KINDS if k != "randn"),
    MergeCase(7, dtype="fp32", lse="far"), MergeCase(7, dtype="fp32", lse="huge-out"),
    MergeCase(7, dtype="fp32", lse="mixed-inf"),
    MergeCase(1, num_heads=1, head_dim=24), MergeCase(33, num_heads=16, head_dim=80),
    MergeCase(0),
]


@pytest.mark.parametrize("case", MERGE_CASES, ids=[c.id for c in MERGE_CASES])
def test_merge_matches_oracle(impl, case):
    """Random parts, far-apart and -inf LSEs, empty parts, zero rows: the merge equals the float64 formula;
    a row with both parts empty is exactly 0 with LSE -inf."""
    _require_dtype(impl, case.torch_dtype, case.dtype)
    x = cascade.build_merge(case, impl.device)
    ref = cascade.merge(x.out_a, x.lse_a, x.out_b, x.lse_b)
    result, buffers = _merge(impl, x.out_a, x.lse_a, x.out_b, x.lse_b, context=case.id)
    _check_merged(result, buffers, ref, case.torch_dtype, case.tolerance, context=case.id)
    both_empty = torch.isinf(ref.lse).cpu()
    got = result[0].detach().cpu()
    assert torch.equal(got[both_empty], torch.zeros_like(got[both_empty])), f"{case.id}: empty row not 0"


def test_merge_is_symmetric_and_in_place(impl):
    """merge(A, B) == merge(B, A) within the bounds, and ``out=out_a`` (in place) gives the same result."""
    case = MergeCase(9, dtype="fp32", lse="mixed-inf")
    _require_dtype(impl, case.torch_dtype, case.dtype)
    x = cascade.build_merge(case, impl.device)
    ref = cascade.merge(x.out_a, x.lse_a, x.out_b, x.lse_b)
    result, buffers = _merge(impl, x.out_b, x.lse_b, x.out_a, x.lse_a, context=f"{case.id},swapped")
    _check_merged(result, buffers, ref, case.torch_dtype, case.tolerance, context=f"{case.id},swapped")
    out_a, lse_a = x.out_a.clone(), x.lse_a.clone()
    impl.merge_attn_states(out_a, lse_a, x.out_b, x.lse_b, out=out_a, out_lse=lse_a)
    tol = case.tolerance
    checks.check_tensor(out_a, ref.out, case.torch_dtype, rel=tol.rel, max_abs=tol.max_abs, what="in_place_out",
                        context=case.id)
    bound = cascade.lse_bound(tol, ref.lse)
    checks.check_tensor(lse_a, ref.lse, torch.float32, rel=bound, max_abs=bound, what="in_place_lse",
                        context=case.id)


CASCADE_CONTROL = CascadeCase(block_size=16, prefix_len=64, suffix_lens=(5, 17, 1, 33, 16, 2),
                              q_lens=(1, 1, 1, 1, 1, 1))
CASCADE_CASES = [
    CASCADE_CONTROL,
    CascadeCase(16, 64, (5, 17, 1, 33, 16, 2), (1, 1, 1, 1, 1, 1), dtype="fp16"),
    CascadeCase(16, 64, (5, 17, 1, 33, 16, 2), (1, 1, 1, 1, 1, 1), dtype="bf16"),
    CascadeCase(16, 64, (5, 17, 9, 33), (5, 3, 9, 1), num_heads=8, num_kv_heads=2),  # prefill queries
    CascadeCase(5, 35, (4, 11, 1), (2, 11, 1), num_heads=10, num_kv_heads=2, dtype="fp16"),
    CascadeCase(16, 48, (7, 20, 3), (1, 4, 3), query="peaky"),  # one part dominates
    CascadeCase(16, 0, (7, 20), (1, 5)),  # an empty prefix: its part has LSE -inf
]


@pytest.mark.parametrize("case", CASCADE_CASES, ids=[c.id for c in CASCADE_CASES])
def test_cascade_merge_of_exact_parts(impl, case):
    """The oracle's prefix and suffix parts (rounded to the case's dtype) merged by the implementation
    equal the oracle's attention over the full tables."""
    _require_dtype(impl, case.torch_dtype, case.dtype)
    x = cascade.build_cascade(case, impl.device)
    prefix, suffix = cascade.expected_parts(x)
    dt, dev = case.torch_dtype, impl.device
    parts = (prefix.out.to(dt).to(dev), prefix.lse.float().to(dev), suffix.out.to(dt).to(dev),
             suffix.lse.float().to(dev))
    ref = cascade.merge(*parts)  # the exact merge of the rounded parts: what the merge alone is judged on
    result, buffers = _merge(impl, *parts, context=case.id)
    _check_merged(result, buffers, ref, dt, case.tolerance, context=case.id)
    full = cascade.expected_full(x)
    checks.check_tensor(ref.out, full.out, torch.float64, rel=case.tolerance.rel, max_abs=case.tolerance.max_abs,
                        what="rounded_parts_vs_full", context=case.id)


@pytest.mark.parametrize("case", CASCADE_CASES, ids=[c.id for c in CASCADE_CASES])
def test_cascade_with_its_own_attention(impl, case):
    """The implementation's own prefix part (decode of every query over the shared prefix blocks) and
    suffix part (prefill over each sequence's own blocks), both with LSE, merged by its own merge,
    equal the oracle's full attention: what a cascade path of an engine computes."""
    _require_dtype(impl, case.torch_dtype, case.dtype)
    if not impl.capabilities.returns_lse:
        pytest.skip(f"not supported: {impl.name} does not return LSE")
    if case.prefix_len == 0 and not impl.capabilities.zero_length_rows:
        pytest.skip(f"not supported: {impl.name} does not support zero-length rows")
    x = cascade.build_cascade(case, impl.device)
    full = cascade.expected_full(x)
    pre = impl.paged_decode(x.q, x.k_cache, x.v_cache, x.prefix_tables, x.prefix_lens, scale=x.scale,
                            out=builders.nan_like(x.q), return_lse=True)
    suf = impl.paged_prefill(x.q, x.k_cache, x.v_cache, x.suffix_tables, x.suffix_lens, x.cu_seqlens_q,
                             scale=x.scale, out=builders.nan_like(x.q), return_lse=True)
    (pre_out, pre_lse), (suf_out, suf_lse) = checks.split_result(pre, True), checks.split_result(suf, True)
    result, buffers = _merge(impl, pre_out, pre_lse, suf_out, suf_lse, context=case.id)
    _check_merged(result, buffers, full, case.torch_dtype, case.tolerance, context=case.id)

