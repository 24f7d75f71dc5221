"""The one way a numerics test runs a case: build, poison ``out=``, call, check against the oracle."""

from __future__ import annotations

import pytest
import torch
from pagedbench.conformance import builders, checks, oracle
from pagedbench.conformance.cases import AttentionCase


def run_and_check(impl, case: AttentionCase, *, x: builders.PagedInputs | None = None,
                  ref: oracle.OracleResult | None = None, return_lse: bool = False,
                  **overrides) -> torch.Tensor:
    """Run ``case`` on ``impl`` (inputs ``x``, built from the case when not given) with a NaN-filled
    ``out=``, check the result and the caller's buffer against the oracle (``ref``, computed when not
    given) in the order exception, shape, dtype, non-finite, tolerance; returns ``out``.

    A dtype the implementation does not claim is reported as "not supported" (a skip with the reason).
    """
    if case.torch_dtype not in impl.dtypes:
        pytest.skip(f"not supported: {impl.name} does not claim {case.dtype}")
    x = builders.build(case, impl.device) if x is None else x
    out = builders.nan_out(x.q.shape[0], x.q)
    result = builders.call(impl, case, x, out=out, return_lse=return_lse, **overrides)
    ref = builders.expected(case, x) if ref is None else ref
    got = checks.check_attention(result, ref, case.torch_dtype, case.tolerance, context=case.id,
                                 return_lse=return_lse)
    checks.check_case_tensor(out, ref.out, case, what="out_buffer")  # the caller's buffer got every element
    return got
