"""The kernels compile for sm_90 without a GPU (Triton's own ptxas/cuobjdump): one pinned configuration
per kernel and dtype, with no register spill, tensor-core instructions in fp16/bf16 prefill, and no
``tt.dot`` made by Triton's combiner out of the float32 broadcast product at GQA group 16.
The full sweep over every configuration the launchers can choose is ``python -m pagedbench.kernels.compile_check``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_fast_compile_check_passes(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    run = subprocess.run([sys.executable, "-m", "pagedbench.bench.compile_check", "--fast", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    prefill = [line for line in run.stdout.splitlines() if "_prefill_kernel" in line and "fp32" not in line]
    assert len(prefill) == 3 and all("tensor-core instructions 0" not in line for line in prefill), prefill
    report = json.loads((tmp_path / "compile_check.json").read_text())
    rows = report["configurations"]
    assert len(rows) == 22 and all(r["stack_bytes"] == 0 and not r["problems"] for r in rows)
    assert "**22 of 22 configurations pass.**" in (tmp_path / "compile_check.md").read_text()
