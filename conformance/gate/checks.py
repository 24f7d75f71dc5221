"""Comparisons, in the order exception → shape → dtype → non-finite → tolerance, with errors recorded.

Every comparison records its measured errors (max abs, relative) for the running test; the conftest
hook attaches them to the test's report (``user_properties``: they appear in the JUnit XML and in the
gate's JSON summary), so a passing case shows how close it was too.
"""

from __future__ import annotations

import os

import torch
from pagedbench.conformance.gate.cases import Tolerance
from pagedbench.conformance.gate.oracle import OracleResult

#: errors measured by the running test: nodeid -> {name: value}
RECORDED: dict[str, dict[str, float]] = {}


def _current_test() -> str:
    # "conformance/test_decode.py::test_x[...] (call)" -> the nodeid
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def record(name: str, value: float) -> None:
    """Keep the worst ``value`` seen under ``name`` for the running test."""
    errors = RECORDED.setdefault(_current_test(), {})
    errors[name] = max(errors.get(name, value), value)


def take_recorded(nodeid: str) -> dict[str, float]:
    return RECORDED.pop(nodeid, {})


def errors_of(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max abs error, ‖actual − expected‖ / ‖expected‖) in float64; -inf entries equal on both sides
    count as exact."""
    a, e = actual.detach().cpu().to(torch.float64), expected.to(torch.float64)
    diff = torch.where(a == e, torch.zeros_like(a), a - e)  # also makes -inf == -inf exact
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    denom = float(torch.where(torch.isfinite(e), e, torch.zeros_like(e)).norm())
    rel = float(diff.norm()) / denom if denom > 0 else float(diff.norm())
    return max_abs, rel


def check_tensor(actual, expected: torch.Tensor, dtype: torch.dtype, *, rel: float, max_abs: float,
                 what: str, context: str) -> None:
    """``actual`` must have ``expected``'s shape, the given dtype, no NaN/inf where ``expected`` is
    finite, and errors within (rel, max_abs). ``context`` (the case id) goes into every message."""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{context}: {what}: expected a Tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{context}: {what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dtype != dtype:
        raise AssertionError(f"{context}: {what}: dtype {actual.dtype}, expected {dtype}")
    a = actual.detach().cpu()
    bad = ~torch.isfinite(a.to(torch.float64)) & torch.isfinite(expected)
    bad |= torch.isnan(a.to(torch.float64)) & ~torch.isnan(expected)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{context}: {what}: {int(bad.sum())} non-finite values (first at {idx}: "
                             f"{a[idx].item()}, expected {expected[idx].item()})")
    wrong_inf = torch.isinf(expected) & (a.to(torch.float64) != expected)
    if bool(wrong_inf.any()):
        idx = tuple(int(i) for i in wrong_inf.nonzero()[0])
        raise AssertionError(
            f"{context}: {what}: expected {expected[idx].item()} at {idx}, got {a[idx].item()}")
    abs_err, rel_err = errors_of(a, expected)
    record(f"{what}_max_abs_err", abs_err)
    record(f"{what}_rel_err", rel_err)
    if rel_err > rel or abs_err > max_abs:
        idx = _argmax_index(a, expected)
        raise AssertionError(
            f"{context}: {what}: rel error {rel_err:.3e} (bound {rel:.0e}), max abs error {abs_err:.3e} "
            f"(bound {max_abs:.0e}) at {idx}: got {a[idx].item():.6g}, expected {expected[idx].item():.6g}")


def check_case_tensor(actual, expected: torch.Tensor, case, *, what: str) -> None:
    """:func:`check_tensor` with ``case``'s dtype, tolerance and id (a ``cases.AttentionCase``)."""
    tol = case.tolerance
    check_tensor(actual, expected, case.torch_dtype, rel=tol.rel, max_abs=tol.max_abs, what=what,
                 context=case.id)


def _argmax_index(a: torch.Tensor, e: torch.Tensor) -> tuple[int, ...]:
    diff = torch.where(a.to(torch.float64) == e, torch.zeros_like(e), a.to(torch.float64) - e).abs()
    flat = int(diff.nan_to_num(0).argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))


def split_result(result, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) from what an implementation returned, checking it returned the right kind of thing."""
    if return_lse:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise AssertionError(f"return_lse=True: expected (out, lse), got {type(result).__name__}")
        return result[0], result[1]
    if isinstance(result, tuple):
        raise AssertionError("return_lse=False: expected a Tensor, got a tuple")
    return result, None


def check_attention(result, ref: OracleResult, dtype: torch.dtype, tol: Tolerance, *, context: str,
                    return_lse: bool = False) -> torch.Tensor:
    """Check an attention result (``out`` or ``(out, lse)``) against the oracle; returns ``out``."""
    out, lse = split_result(result, return_lse)
    check_tensor(out, ref.out, dtype, rel=tol.rel, max_abs=tol.max_abs, what="out", context=context)
    if return_lse:
        check_tensor(lse, ref.lse, torch.float32, rel=tol.lse_abs, max_abs=tol.lse_abs, what="lse",
                     context=context)
    return out


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, *, what: str, context: str) -> None:
    """Byte-for-byte equality (NaN payloads included), naming the first differing element."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{context}: {what}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
    ab, bb = _as_bits(a), _as_bits(b)
    if not torch.equal(ab, bb):
        differ = (ab != bb).nonzero()
        idx = tuple(int(i) for i in differ[0])
        raise AssertionError(f"{context}: {what}: {differ.shape[0]} elements differ; first at {idx}: "
                             f"{a.cpu()[idx].item()} vs {b.cpu()[idx].item()}")


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(view_dtype)
