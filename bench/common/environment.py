"""What every result record carries: schema version, git commit, machine, versions and backend."""

from __future__ import annotations

from pagedbench.conformance.gate.environment import REPO_ROOT, SCHEMA_VERSION, host_environment

RESULTS_DIR = REPO_ROOT / "results"

__all__ = ["RESULTS_DIR", "SCHEMA_VERSION", "environment", "environment_markdown"]


def environment() -> dict[str, object]:
    """The environment record (nested fields; see STYLE.md "Benchmarks and results")."""
    from pagedbench.kernels import device

    return {**host_environment(), "device": device.describe()}


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
