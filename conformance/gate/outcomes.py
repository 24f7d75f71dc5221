"""How one test's reports become one case of the gate: outcome, category and validation verdict.

Categories (what part of the contract a case checks):

* ``numerics``      -- attention results, cache writes and copies (the default);
* ``block-manager`` -- block accounting and copy-on-write (the ``test_block_manager*`` and
  ``test_copy_on_write_data`` modules);
* ``validation``    -- the implementation rejects bad arguments (``test_kernel_validation``, and tests
  marked ``@pytest.mark.validation``).

Outcomes: ``pass``; ``fail`` (an assertion: a wrong result); ``error`` (something other than an
assertion was raised); ``crashed`` (the worker process died or timed out in the case: set by the gate,
never here); ``accepts invalid`` (a validation case whose call returned normally); ``not supported`` (a
skip whose reason starts with "not supported"); ``skipped`` (any other skip).

A validation case also gets a ``validation`` verdict: ``rejects`` (pass), ``accepts-invalid`` (the call
returned), ``wrong-error`` (it raised something the test did not accept), ``crashes`` (the process died),
``check-failed`` (it raised, but a check made afterwards failed: the caller's cache or buffer was
written, the state changed, or the message was wrong).
"""

from __future__ import annotations

from pathlib import Path

import pytest

CATEGORIES = ("numerics", "block-manager", "validation")
MODULE_CATEGORY = {
    "test_block_manager.py": "block-manager",
    "test_block_manager_scenarios.py": "block-manager",
    "test_block_manager_stateful.py": "block-manager",
    "test_copy_on_write_data.py": "block-manager",
    "test_kernel_validation.py": "validation",
}
OUTCOMES = ("pass", "fail", "error", "crashed", "accepts invalid", "not supported", "skipped")
VALIDATION_VERDICTS = ("rejects", "accepts-invalid", "wrong-error", "crashes", "check-failed")
#: validation verdicts that are findings, reported but failing the gate only with --strict-validation
#: (rejecting bad input is the implementation's choice; corrupting the caller's data is not)
VALIDATION_FINDINGS = ("accepts-invalid", "wrong-error", "crashes")


def category_of(item: pytest.Item) -> str:
    if item.get_closest_marker("validation") is not None:
        return "validation"
    return MODULE_CATEGORY.get(Path(str(item.fspath)).name, "numerics")


def failure_kind(excinfo: pytest.ExceptionInfo | None) -> str | None:
    """``accepts-invalid`` (the call under ``rejected()``/``pytest.raises`` returned), ``assertion``
    (an ``AssertionError`` or ``pytest.fail``), ``exception`` (anything else), None (nothing raised)."""
    from pagedbench.conformance.gate.validation import AcceptedInvalidInput

    if excinfo is None:
        return None
    if excinfo.errisinstance(AcceptedInvalidInput):
        return "accepts-invalid"
    if excinfo.errisinstance(pytest.fail.Exception):
        return "accepts-invalid" if str(excinfo.value).startswith("DID NOT RAISE") else "assertion"
    if excinfo.errisinstance(AssertionError):
        return "assertion"
    return "exception"


def outcome_of(report: pytest.TestReport, category: str, kind: str | None) -> str:
    if report.passed:
        return "pass"
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return "not supported" if "not supported" in reason else "skipped"
    if report.when != "call":
        return "error"
    if kind == "accepts-invalid":
        return "accepts invalid" if category == "validation" else "fail"
    return "fail" if kind == "assertion" else "error"


def validation_verdict(outcome: str) -> str | None:
    """The verdict of a validation case with this outcome (None: nothing was judged)."""
    return {"pass": "rejects", "accepts invalid": "accepts-invalid", "error": "wrong-error",
            "crashed": "crashes", "fail": "check-failed"}.get(outcome)


def fails_gate(entry: dict, *, strict_validation: bool) -> bool:
    """Whether this case makes the gate's exit status non-zero."""
    if entry["outcome"] in ("pass", "not supported", "skipped"):
        return False
    if entry.get("validation") in VALIDATION_FINDINGS:
        return strict_validation
    return True
