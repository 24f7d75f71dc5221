"""Writing results: every file appears whole or not at all.

A study killed mid-write (Ctrl-C, the OOM killer, a CI time-out) must never leave a 0-byte or half
JSON in ``results/``: each file is written to a temporary file in the same folder, flushed to disk and
renamed over the target (``os.replace`` is atomic within one file system).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

SCHEMA_VERSION = 2


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        Path(tmp).write_text(text)

    _atomic(path, write)


def write_json(path: Path, doc: object) -> None:
    write_text(path, json.dumps(doc, indent=1, default=str) + "\n")


def save_figure(fig, path: Path, **kwargs) -> None:
    """``fig.savefig`` through a temporary file (the format comes from ``path``'s suffix)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    _atomic(path, lambda tmp: fig.savefig(tmp, format=fmt, **kwargs))
