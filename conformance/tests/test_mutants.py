"""The mutation check: the suite must fail every deliberately broken implementation (``conformance.mutation.mutants``).

For each ``mutant-*`` the part of the suite that covers what it breaks runs in a subprocess against it
(``-x``: the first failure kills it) and must fail; the unbroken ``control`` must pass the same tests, so
each kill is the mutation's doing. The kill table (mutant, verdict, first failing test) is printed at
the end of the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from pagedbench.conformance import registry
from pagedbench.conformance.gate import runner as gate

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "conformance" / "suite"
SUITES = {
    # int64 and cache-op files first: cheap, and they are what the write/offset mutants break
    "numerics": ["test_int64_offsets.py", "test_cache_ops.py", "test_decode.py", "test_prefill.py",
                 "test_metamorphic.py"],
    # the newer families, cheapest first: each mutant there dies in the first module that covers it
    "merge_and_shapes": ["test_dispatch_boundaries.py", "test_batch_invariance.py", "test_merge_states.py",
                         "test_fp8_kv.py", "test_gqa_groups.py", "test_long_context.py"],
    # layouts and batch positions: strided views (and a plan reused across them), the odd sequence of a
    # batch at every index, a layer-packed cache past 2^32 elements
    "layouts": ["test_batch_positions.py", "test_strided_layouts.py", "test_layer_packed_cache.py"],
    # tensor-parallel shards: each rank's heads alone, in its own pool or a view of one shared cache
    "tensor_parallel": ["test_tensor_parallel.py"],
    # metadata from our engine's scheduler: blocks shared across a batch, tables with no spare column
    "engine_metadata": ["test_engine_metadata.py"],
    "block_manager": ["test_block_manager.py", "test_block_manager_scenarios.py",
                      "test_copy_on_write_data.py", "test_block_manager_stateful.py"],
}


@dataclass(frozen=True, slots=True)
class Kill:
    """One row of the kill table."""

    mutant: str
    killed: bool
    first_failure: str  # the nodeid of the test that failed first ("" when it survived)
    seconds: float


#: rows of the kill table, printed by conftest's pytest_terminal_summary
KILL_TABLE: list[Kill] = []


def suite_files(part: str) -> list[str]:
    return [str(SUITE / f) for f in SUITES[part] if (SUITE / f).exists()]


def run_suite(impl_name: str, part: str, *, stop_at_first: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", *suite_files(part), "-q", "--impl", impl_name, "-m", "not slow",
           "-p", "no:cacheprovider", "-o", "addopts=-ra --strict-markers", *gate.SUITE_PYTEST_ARGS]
    if stop_at_first:
        cmd.append("-x")
    env = {**os.environ, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            path, _, test = line.split(" ", 1)[1].split(" - ", 1)[0].partition("::")
            return f"{Path(path).name}::{test}"
    return ""


@pytest.mark.mutants
@pytest.mark.parametrize("name", registry.mutant_names())
def test_mutant_is_killed(name):
    impl = registry.get(name)
    assert not impl.expected_to_pass, f"{name} is registered as a mutant but expected_to_pass is True"
    start = time.perf_counter()
    proc = run_suite(name, impl.breaks, stop_at_first=True)
    seconds = time.perf_counter() - start
    failed = first_failure(proc.stdout)
    KILL_TABLE.append(Kill(name, proc.returncode == 1 and bool(failed), failed, seconds))
    assert proc.returncode != 0, f"{name} SURVIVED: the {impl.breaks} suite passed against it"
    assert proc.returncode == 1 and failed, (
        f"{name}: the suite did not run cleanly (exit {proc.returncode}):\n{_tail(proc)}")


@pytest.mark.mutants
@pytest.mark.parametrize("part", sorted(SUITES))
def test_control_passes(part):
    """The unbroken base of the mutants passes the suites that kill them."""
    proc = run_suite("control", part, stop_at_first=False)
    assert proc.returncode == 0, f"control fails the {part} suite:\n{_tail(proc)}"


def _tail(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-4000:] + proc.stderr[-2000:]
