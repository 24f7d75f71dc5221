"""Writing results: every file appears whole or not at all.

A study killed mid-write (Ctrl-C, the OOM killer, a CI time-out) must never leave a 0-byte or half
JSON in ``results/``: each file is written to a temporary file in the same folder, flushed to disk and
renamed over the target (``os.replace`` is atomic within one file system).
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedbench.conformance.report_files import replace_atomically, write_atomically

SCHEMA_VERSION = 2


def write_text(path: Path, text: str) -> None:
    write_atomically(Path(path), text)


def write_json(path: Path, doc: object) -> None:
    write_text(path, json.dumps(doc, indent=1, default=str) + "\n")


def save_figure(fig, path: Path, **kwargs) -> None:
    """``fig.savefig`` through a temporary file (the format comes from ``path``'s suffix)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    replace_atomically(Path(path), lambda tmp: fig.savefig(tmp, format=fmt, **kwargs))
