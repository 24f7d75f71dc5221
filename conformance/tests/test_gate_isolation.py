"""The gate against outside implementations (``outside_impls``, loaded with ``--load``): crashes are
recorded and the files still written, a hang is ended by ``--timeout``, validation findings go to their
own column, a rejection that corrupts the cache fails, an implementation without LSE still has its
output judged, and the gate imports neither our kernels nor Triton for it.

Each test is one or two gate subprocesses on a one- or two-case selection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pagedbench.conformance.gate import outcomes

ROOT = Path(__file__).resolve().parents[2]
LOAD = "pagedbench.conformance.tests.outside_impls"
CONTROL = "decode/bs=16,ctx=97+16+1+33,hq=4,hkv=2,d=64,fp16]"


def gate(out: Path, impl: str, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "pagedbench.conformance", "--impl", impl, "--load", LOAD, "--out", str(out), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, **(env or {})})
    path = out / f"{impl}.json"
    assert path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return run, json.loads(path.read_text())


def by_test(summary: dict) -> dict[str, dict]:
    """test function name -> its (only) case entry."""
    return {nodeid.split("::")[1].split("[")[0]: entry for nodeid, entry in summary["cases"].items()}


def test_a_crashing_implementation_is_recorded_and_the_files_are_written(tmp_path):
    run, summary = gate(tmp_path, "outside-aborts", "-k", "test_decode_matches_oracle",
                        "--case", CONTROL, "--case", CONTROL.replace("fp16", "fp32"))
    assert run.returncode == 1, run.stdout[-2000:]
    crashed = {n: e for n, e in summary["cases"].items() if e["outcome"] == "crashed"}
    assert len(crashed) == 2, summary["cases"]  # the first killed its worker; the second, resumed, too
    assert all("SIGABRT" in e["message"] for e in crashed.values()), crashed
    assert summary["counts"]["crashed"] == 2 and summary["counts_by_category"]["numerics"]["crashed"] == 2
    junit = (tmp_path / "outside-aborts.junit.xml").read_text()
    assert junit.count("<testcase") == 2 and junit.count('<error type="crashed"') == 2
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary file behind


def test_validation_findings_have_a_column_and_corruption_fails(tmp_path):
    run, summary = gate(tmp_path, "outside-sloppy",
                        "-k", "test_decode_matches_oracle or test_decode_rejects_mismatched_shapes "
                              "or test_write_kv_rejects_mismatched_shapes",
                        "--case", CONTROL, "--case", "q-num-seqs", "--case", "k-heads")
    cases = by_test(summary)
    assert cases["test_decode_matches_oracle"]["outcome"] == "pass"
    accepts = cases["test_decode_rejects_mismatched_shapes"]
    assert (accepts["outcome"], accepts["category"], accepts["validation"]) == (
        "accepts invalid", "validation", "accepts-invalid"), accepts
    corrupts = cases["test_write_kv_rejects_mismatched_shapes_and_writes_nothing"]
    assert (corrupts["outcome"], corrupts["validation"]) == ("fail", "check-failed"), corrupts
    assert "cache was written" in corrupts["message"]
    assert summary["validation"]["accepts-invalid"] == 1 and summary["counts"]["error"] == 0
    # the corruption fails the gate; accepting bad input alone does so only under --strict-validation
    assert run.returncode == 1 and summary["failing_cases"] == [
        n for n in summary["cases"] if "test_write_kv" in n]
    assert not outcomes.fails_gate(accepts, strict_validation=False)
    assert outcomes.fails_gate(accepts, strict_validation=True)


def test_without_lse_outputs_are_still_judged_and_no_kernel_is_imported(tmp_path):
    modules_file = tmp_path / "modules.jsonl"
    env = {"PAGEDBENCH_TEST_MODULES_FILE": str(modules_file)}
    env_without_interpreter = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd_env = {**env_without_interpreter, **env}
    run = subprocess.run([sys.executable, "-m", "pagedbench.conformance", "--impl", "outside-nolse",
                          "--load", LOAD, "--out", str(tmp_path), "-k", "test_decode_lse_and_fully_masked_rows",
                          "--case", "ctx=0+17+1+97,"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=cmd_env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "outside-nolse.json").read_text())
    (entry,) = summary["cases"].values()
    assert entry["outcome"] == "pass" and entry["not_supported"] == ["lse"], entry
    assert entry["errors"]["out_max_abs_err"] >= 0  # the output was compared with the oracle
    assert summary["capabilities"]["returns_lse"] is False
    records = [json.loads(line) for line in modules_file.read_text().splitlines()]
    assert len(records) >= 2  # the collecting worker and the one that ran the case
    for r in records:
        assert r["modules"] == [] and r["TRITON_INTERPRET"] is None, r


def test_a_hanging_implementation_is_timed_out_and_the_files_are_written(tmp_path):
    """``--timeout``: the worker of a module whose case never returns is killed after that many seconds,
    the case is recorded as crashed with the reason, and both files are still written. The clock starts
    once a worker has collected its cases, so a short limit holds however long the worker took to
    import torch."""
    timeout_s = 4
    run, summary = gate(tmp_path, "outside-hangs", "-k", "test_write_kv_writes_exactly_its_slots",
                        "--case", "write_kv/bs=5,blocks=9,", "--timeout", str(timeout_s))
    assert run.returncode == 1, run.stdout[-2000:]
    (nodeid, entry), = summary["cases"].items()
    assert "test_write_kv_writes_exactly_its_slots" in nodeid and "bs=5,blocks=9," in nodeid, nodeid
    assert entry["outcome"] == "crashed", entry
    assert entry["message"].startswith(f"worker timed out after {timeout_s} s while this case ran"), entry
    assert summary["counts"]["crashed"] == 1 and summary["counts"]["pass"] == 0
    junit = (tmp_path / "outside-hangs.junit.xml").read_text()
    assert junit.count("<testcase") == 1 and junit.count('<error type="crashed"') == 1
    assert "timed out after" in junit
    assert not list(tmp_path.glob(".*.tmp"))
