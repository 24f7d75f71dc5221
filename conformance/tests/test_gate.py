"""The gate (`python -m pagedbench.conformance`): exit status, JUnit XML and JSON summary.

Each run is a subprocess on a one-case selection, so the file stays fast.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CONTROL = "decode/bs=16,ctx=97+16+1+33,hq=4,hkv=2,d=64,fp16]"


def gate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedbench.conformance", "--out", str(tmp_path), "-k", "test_decode_matches_oracle",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize(("name", "status", "outcome"),
                         [("torch", 0, "pass"), ("mutant-off-by-one-length", 1, "fail")])
def test_gate_reports_pass_and_fail(tmp_path, name, status, outcome):
    run = gate(tmp_path, "--impl", name, "--case", CONTROL)
    assert run.returncode == status, run.stdout[-2000:] + run.stderr[-2000:]
    summary = json.loads((tmp_path / f"{name}.json").read_text())
    assert summary["implementation"] == name
    outcomes = [c["outcome"] for c in summary["cases"].values()]
    assert outcomes == [outcome], summary["cases"]
    assert summary["environment"]["git"]["commit"]
    assert (tmp_path / f"{name}.junit.xml").read_text().count("<testcase") == 1


def test_gate_fails_when_nothing_ran(tmp_path):
    run = gate(tmp_path, "--impl", "torch", "--case", "no-such-case-id")
    assert run.returncode == 1
    assert "FAILED: no case selected (check -k and --case)" in run.stdout
