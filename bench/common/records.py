"""Writing results: every file appears whole or not at all.

A study killed mid-write (Ctrl-C, the OOM killer, a CI time-out) must never leave a 0-byte or half
JSON in ``results/``: each file is written to a temporary file in the same folder, flushed to disk and
renamed over the target (``os.replace`` is atomic within one file system).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedbench.conformance.gate.report_files import replace_atomically, write_atomically

SCHEMA_VERSION = 2


def write_text(path: Path, text: str) -> None:
    write_atomically(Path(path), text)


def write_json(path: Path, doc: object) -> None:
    write_text(path, json.dumps(doc, indent=1, default=str) + "\n")


def save_figure(fig, path: Path, **kwargs) -> None:
    """``fig.savefig`` through a temporary file (the format comes from ``path``'s suffix)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    replace_atomically(Path(path), lambda tmp: fig.savefig(tmp, format=fmt, **kwargs))


def study_parser(prog: str, description: str | None, config: Path, results_dir: Path) -> argparse.ArgumentParser:
    """The command line the config-driven studies share: ``--full``, ``--config``, ``--out``, ``--no-plots``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--full", action="store_true", help="the config's `full` sweeps")
    parser.add_argument("--config", default=str(config), help="YAML config (default: %(default)s)")
    parser.add_argument("--out", default=str(results_dir), help="output folder (default: results/)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser
