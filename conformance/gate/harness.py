"""The one way a numerics test runs a case: build, poison ``out=``, call, check against the oracle."""

from __future__ import annotations

import torch
from pagedbench.conformance import capabilities
from pagedbench.conformance.gate import builders, checks, oracle
from pagedbench.conformance.gate.cases import AttentionCase


def run_and_check(impl, case: AttentionCase, *, x: builders.PagedInputs | None = None,
                  ref: oracle.OracleResult | None = None, return_lse: bool = False,
                  **overrides) -> torch.Tensor:
    """Run ``case`` on ``impl`` (inputs ``x``, built from the case when not given) with a NaN-filled
    ``out=``, check the result and the caller's buffer against the oracle (``ref``, computed when not
    given) in the order exception, shape, dtype, non-finite, tolerance; returns ``out``.

    A case needing what the implementation does not declare (``impl.capabilities``: dtype, block size,
    window, splits, zero-length rows) is reported as "not supported" (a skip with the reason); LSE is
    compared only when the implementation returns it (the output is checked either way, and the case
    records ``lse`` as not supported).
    """
    capabilities.require(impl, case, num_splits=overrides.get("num_splits"))
    if return_lse and not impl.capabilities.returns_lse:
        capabilities.note_unchecked("lse")
        return_lse = False
    x = builders.build(case, impl.device) if x is None else x
    out = builders.nan_out(x.q.shape[0], x.q)
    result = builders.call(impl, case, x, out=out, return_lse=return_lse, **overrides)
    ref = builders.expected(case, x) if ref is None else ref
    got = checks.check_attention(result, ref, case.torch_dtype, case.tolerance, context=case.id,
                                 return_lse=return_lse)
    checks.check_case_tensor(out, ref.out, case, what="out_buffer")  # the caller's buffer got every element
    return got
