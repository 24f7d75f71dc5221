"""Input-validation checks: an implementation must reject bad arguments, and reject them cleanly.

``with rejected(): call(...)`` passes when the call raises (any exception but ``NotSupported``, which
still reports "not supported"); when it returns, :class:`AcceptedInvalidInput` is raised, which the gate
reports in its validation column (``accepts-invalid``) rather than as a wrong result. What the caller's
data must look like after the rejection is checked *after* the ``with`` block, never inside it (an
assertion inside would be swallowed as "it raised").
"""

from __future__ import annotations

import contextlib

from pagedbench.conformance.adapter import NotSupported


class AcceptedInvalidInput(AssertionError):
    """The implementation returned normally from a call with invalid arguments."""


@contextlib.contextmanager
def rejected(what: str = "the mismatched arguments"):
    """The block must raise (any exception but ``NotSupported``)."""
    try:
        yield
    except NotSupported:
        raise
    except Exception:
        return
    raise AcceptedInvalidInput(f"{what} were accepted")
