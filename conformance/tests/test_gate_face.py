"""What a kernel author sees of the gate: the preflight (a bad ``--load``, an implementation that cannot be
built, a device this machine lacks: exit status 2, one line, nothing written), one line per failing case
with its measured error against the bound and a closing list, counts that keep validation apart, ``--help``
listing the implementations (the mutation check's hidden), file modes, and the default output folder.

Each test is one gate subprocess on a one-case selection (the preflight ones run no case at all).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagedbench.conformance.gate import report_files
from pagedbench.conformance.gate import runner as gate

ROOT = Path(__file__).resolve().parents[2]
LOAD = "pagedbench.conformance.tests.outside_impls"
CONTROL = "decode/bs=16,ctx=97+16+1+33,hq=4,hkv=2,d=64,fp16]"


def run_gate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedbench.conformance", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def written(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_a_load_that_does_not_import_stops_before_any_case(tmp_path):
    run = run_gate("--impl", "mine", "--load", "pagedbench.conformance.tests.no_such_adapter", "--out",
                   str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "--load pagedbench.conformance.tests.no_such_adapter: cannot import it" in run.stderr
    assert "ModuleNotFoundError" in run.stderr
    assert "crashed" not in run.stdout + run.stderr and "no test passed" not in run.stdout
    assert written(tmp_path) == []


def test_an_implementation_that_cannot_be_built_stops_before_any_case(tmp_path):
    run = run_gate("--impl", "outside-broken-init", "--load", LOAD, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "cannot construct 'outside-broken-init': RuntimeError: libmykernels.so" in run.stderr
    assert written(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the device the test pretends is missing")
def test_a_device_this_machine_lacks_is_one_environment_error(tmp_path):
    run = run_gate("--impl", "outside-cuda", "--load", LOAD, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "environment error" in lines[0] and "cuda" in lines[0]
    assert written(tmp_path) == []


def test_a_failing_case_is_one_line_with_its_error_and_bound_and_is_listed_at_the_end(tmp_path):
    run = run_gate("--impl", "mutant-off-by-one-length", "-k", "test_decode_matches_oracle", "--case", CONTROL,
                   "--out", str(tmp_path), cwd=ROOT)
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    assert "Traceback" not in out + run.stderr and "def " not in out  # no tracebacks or source without -v
    assert not re.search(r"\d+ (passed|failed|skipped) in ", out + run.stderr)  # no worker's pytest summary
    lines = out.splitlines()
    fail = [i for i, line in enumerate(lines) if line.lstrip().startswith("FAIL ")]
    assert len(fail) == 1, out
    detail = lines[fail[0] + 1]
    assert detail.split() [:4] == ["decode_matches_oracle:", "out:", "rel", "error"], detail
    assert "(bound 1e-03)" in detail, detail
    closing = lines.index("failing cases (1):")
    assert "test_decode_matches_oracle[mutant-off-by-one-length-" in lines[closing + 1]
    assert lines[-1].startswith("conformance gate [mutant-off-by-one-length]: FAILED")
    assert len(lines) <= 10, out


def test_verbose_adds_the_workers_tracebacks(tmp_path):
    run = run_gate("--impl", "mutant-off-by-one-length", "-k", "test_decode_matches_oracle", "--case", CONTROL,
                   "--out", str(tmp_path), "-v", cwd=ROOT)
    assert run.returncode == 1
    assert "AssertionError" in run.stdout and len(run.stdout.splitlines()) > 20


def test_the_headline_keeps_validation_and_capabilities_apart():
    summary = {"counts": {"pass": 8, "fail": 0, "not supported": 26},
               "counts_by_category": {"numerics": {"pass": 1, "not supported": 20},
                                      "block-manager": {"not supported": 6},
                                      "validation": {"pass": 7}},
               "validation": {"rejects": 7, "accepts-invalid": 0}}
    line = gate.headline("mine", summary)
    assert line == ("conformance gate [mine]: numerics 1 pass; validation 7 rejects; "
                    "26 not supported (declared capabilities)")
    assert "8 pass" not in line


def test_help_lists_implementations_but_not_the_mutation_checks():
    run = run_gate("--help", cwd=ROOT)
    assert run.returncode == 0
    text = " ".join(run.stdout.split())
    assert "implementations: " in text
    for name in ("triton", "torch", "torch-batched", "flex"):
        assert name in text
    assert "mutant-" not in text and "control" not in text


def test_an_unknown_implementation_lists_only_the_offered_ones(tmp_path):
    run = run_gate("--impl", "tritonn", "--out", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 2
    assert "unknown implementation 'tritonn'; known:" in run.stderr and "triton" in run.stderr
    assert "mutant-" not in run.stderr and "control" not in run.stderr


def test_result_files_are_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        report_files.write_json(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == report_files.FILE_MODE == 0o644
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}


def test_default_out_is_a_new_folder_under_the_working_directory_not_the_published_results(tmp_path):
    run = run_gate("--impl", "torch", "-k", "test_decode_matches_oracle", "--case", CONTROL, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    files = sorted(p.relative_to(tmp_path) for p in written(tmp_path))
    assert [f.name for f in files] == ["torch.json", "torch.junit.xml"]
    folder = files[0].parent
    assert folder.parent == Path("conformance-results") and folder.name.startswith("torch-")
    for f in files:
        assert stat.S_IMODE((tmp_path / f).stat().st_mode) & 0o044 == 0o044  # readable by group and others
    assert gate.default_out("torch", 0.0) != gate.default_out("torch", 1.0)


def test_modules_run_at_once_with_jobs_report_as_one_at_a_time(tmp_path):
    """--jobs runs suite modules in parallel workers; lines, cases and outcomes are those of a serial run,
    in the suite's order."""
    select = ["--impl", "torch", "-k", "test_decode_matches_oracle or test_copy_blocks", "--case",
              "bs=16"]
    runs = {jobs: run_gate(*select, "--jobs", str(jobs), "--out", str(tmp_path / str(jobs)), cwd=ROOT)
            for jobs in (1, 2)}
    docs = {jobs: json.loads((tmp_path / str(jobs) / "torch.json").read_text()) for jobs in runs}
    assert all(r.returncode == 0 for r in runs.values()), runs[2].stdout + runs[2].stderr
    modules = [line.split(":")[0] for line in runs[2].stdout.splitlines() if line.startswith("test_")]
    assert len(modules) == 2 and modules == [line.split(":")[0] for line in runs[1].stdout.splitlines()
                                             if line.startswith("test_")]
    assert {n: e["outcome"] for n, e in docs[2]["cases"].items()} == {
        n: e["outcome"] for n, e in docs[1]["cases"].items()}
    assert list(docs[2]["cases"]) == list(docs[1]["cases"])


def test_jobs_below_one_is_refused():
    run = run_gate("--impl", "torch", "--jobs", "0", cwd=ROOT)
    assert run.returncode == 2 and "--jobs: must be >= 1, got 0" in run.stderr
