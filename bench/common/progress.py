"""Whether the studies draw progress bars: on a terminal yes; in a log, in CI or with
``PAGEDBENCH_NO_PROGRESS=1`` no, so redirected output holds results rather than bar redraws."""

from __future__ import annotations

import os
import sys
from typing import TextIO

NO_PROGRESS_ENV = "PAGEDBENCH_NO_PROGRESS"


def progress_enabled(stream: TextIO | None = None) -> bool:
    """True when ``stream`` (default stderr, where tqdm draws) is a terminal and the env var is unset or 0."""
    if os.environ.get(NO_PROGRESS_ENV, "") not in ("", "0"):
        return False
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())
