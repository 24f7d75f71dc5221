"""The environment record of a gate run, built without importing kernels or Triton.

The same fields as ``bench.environment.environment()`` (schema, time, git, machine, versions, read from
package metadata rather than by importing), except ``device``: what the implementation under test
reported about itself (``Implementation.describe()``, from the worker that ran it) — ours reports its
backend there, another project's its device — and the ``TRITON_INTERPRET`` the gate was started with.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(implementation: dict | None) -> dict[str, object]:
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    cupy = next((v for d in ("cupy", "cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x") if (v := _version(d))), None)
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git": {"commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None},
        "machine": {"system": platform.system(), "arch": platform.machine(), "cpu": platform.processor(),
                    "cpu_count": os.cpu_count()},
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "triton": _version("triton"), "numpy": _version("numpy"), "cupy": cupy,
                     "pagedbench": _version("pagedbench")},
        "device": (implementation or {}).get("describe"),
        "triton_interpret_at_start": os.environ.get("TRITON_INTERPRET"),
    }
