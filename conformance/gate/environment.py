"""Where a result came from — schema, time, git, machine, versions — built without importing kernels or Triton.

The gate must not import our kernels (importing ``kernels.device`` decides whether Triton interprets), so
the part of the record that needs neither lives here, read from package metadata rather than by importing;
``bench.environment`` adds the backend our kernels chose. A gate record's ``device`` is instead what the
implementation under test reported about itself (``Implementation.describe()``, from the worker that ran
it) — ours reports its backend there, another project's its device — beside the ``TRITON_INTERPRET``
the gate was started with.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def version_of(dist: str) -> str | None:
    """An installed distribution's version from its metadata (nothing imported); None when absent."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_environment() -> dict[str, object]:
    """Schema, time, git, machine and versions: every record's fields but the device."""
    # results/ is what the harness writes: its own output does not make the source tree dirty.
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    cupy = next((v for d in ("cupy", "cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x") if (v := version_of(d))), None)
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git": {"commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None},
        "machine": {
            "system": platform.system(),
            "arch": platform.machine(),
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "memory_bytes": _memory_bytes(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": version_of("torch"),
            "triton": version_of("triton"),
            "numpy": version_of("numpy"),
            "cupy": cupy,
            "pagedbench": version_of("pagedbench"),
        },
    }


def environment(implementation: dict | None) -> dict[str, object]:
    """A gate run's record: the host's fields, what the implementation said of itself, the interpreter flag."""
    return {
        **host_environment(),
        "device": (implementation or {}).get("describe"),
        "triton_interpret_at_start": os.environ.get("TRITON_INTERPRET"),
    }
