"""What every result record carries: schema version, git commit, machine, versions and backend."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "results"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _version(dist: str) -> str | None:
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


def environment() -> dict[str, object]:
    """The environment record (nested fields; see STYLE.md "Benchmarks and results")."""
    from pagedbench.kernels import device

    # results/ is what the harness writes: its own output does not make the source tree dirty.
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    cupy = next((v for d in ("cupy", "cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x")
                 if (v := _version(d))), None)
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
            "torch": _version("torch"),
            "triton": _version("triton"),
            "numpy": _version("numpy"),
            "cupy": cupy,
            "pagedbench": _version("pagedbench"),
        },
        "device": device.describe(),
    }


def environment_markdown(env: dict) -> str:
    """A short Markdown block naming where a result came from."""
    m, v, g, d = env["machine"], env["versions"], env["git"], env["device"]
    commit = (g["commit"] or "unknown")[:12] + (" (dirty)" if g["dirty"] else "")
    where = d.get("gpu_name") or f"{m['cpu']} ({m['cpu_count']} cores)"
    mem = f"{m['memory_bytes'] / 2**30:.0f} GiB" if m["memory_bytes"] else "?"
    return (
        f"- machine: {where}, {mem} RAM, {m['system']} {m['arch']}\n"
        f"- backend: {d['backend']} ({d['reason']}; Triton interpreter: {d['triton_interpret']})\n"
        f"- versions: python {v['python']}, torch {v['torch']}, triton {v['triton']}, numpy {v['numpy']}, "
        f"cupy {v['cupy'] or 'not installed'}\n"
        f"- commit: {commit}, generated {env['created_utc']}\n"
    )
