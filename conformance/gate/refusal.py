"""How a family that hands an implementation an unusual layout tells a clear refusal from a failure.

An implementation may refuse a layout it does not support, but only clearly: :class:`NotSupported`, or a
``ValueError`` / ``TypeError`` whose message names the layout ("contiguous", "stride", "layout"); the case
is then "not supported". Any other exception fails the case.
"""

from __future__ import annotations

import re

import pytest
from pagedbench.conformance.adapter import NotSupported

__all__ = ["REFUSAL", "call_or_refused"]

#: what a clear refusal of a layout names
REFUSAL = re.compile(r"contiguous|stride|layout", re.IGNORECASE)


def call_or_refused(what: str, fn):
    """``fn()``, with a clear refusal of the layout reported as "not supported" and an unclear one failed."""
    try:
        return fn()
    except NotSupported as e:
        pytest.skip(f"not supported: {e}")
    except (ValueError, TypeError) as e:
        if REFUSAL.search(str(e)):
            pytest.skip(f"not supported: refused the layout: {e}")
        raise AssertionError(f"{what}: refused with a {type(e).__name__} that does not name the layout: {e}") from e
