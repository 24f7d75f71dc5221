"""The command line and record of a study with two built-in configs (quick, and ``--full``'s longer grid):
``--out``, ``--full``; the record is the environment, the study's run and its wall time, written as
``<name>.json`` and ``<name>.md`` through the atomic writer."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records

__all__ = ["run_quick_or_full"]


def run_quick_or_full(argv: list[str], *, prog: str, description: str | None, full_help: str, quick, full,
                      run: Callable[[object], dict], markdown: Callable[[dict], str], name: str) -> dict:
    """Parse ``argv``, run ``run(quick or full)``, write ``<name>.{json,md}`` to ``--out``; returns the record."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", default=str(env_mod.RESULTS_DIR), help="output folder (default: results/)")
    parser.add_argument("--full", action="store_true", help=full_help)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    doc = {"schema_version": records.SCHEMA_VERSION, "environment": env_mod.environment(),
           **run(full if args.full else quick)}
    doc["wall_s"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(doc)
    records.write_json(out / f"{name}.json", doc)
    records.write_text(out / f"{name}.md", text)
    print(text)
    return doc
