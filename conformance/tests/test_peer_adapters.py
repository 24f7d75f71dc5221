"""The outside adapters import in the peers venv (``make peers``), give right answers on one tiny decode,
record their peer's version and whether Triton interprets, and load none of our kernels.

Skipped where that venv is absent or lacks pagedbench (the matrix then shows "not installed" rows). One
subprocess runs every adapter on the same two-sequence case and reports its error against the float64
oracle, what it said about itself, and whether Triton interprets there.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".peers" / "bin" / "python"
ADAPTERS = {"vllm-unified": "vllm_unified", "vllm-paged-decode": "vllm_paged_decode", "sglang-decode": "sglang_decode"}

SCRIPT = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
import importlib
from dataclasses import replace
from pagedbench.conformance import adapter
from pagedbench.conformance import registry
from pagedbench.conformance.gate import builders
from pagedbench.conformance.gate.cases import AttentionCase
names = json.loads(sys.argv[1])
for module in names.values():
    importlib.import_module("pagedbench.conformance.peers." + module)
case = AttentionCase("decode", block_size=16, seq_lens=(5, 17), num_heads=4, num_kv_heads=2, head_dim=32)
x = builders.build(case)
x = replace(x, k_cache=x.k_cache.nan_to_num(0.0), v_cache=x.v_cache.nan_to_num(0.0))
ref = builders.expected(case, x)
report = {}
for name in names:
    impl = registry.get(name)
    out = impl.paged_decode(x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens, scale=x.scale)
    report[name] = {"max_abs_err": float((out.double() - ref.out).abs().max()), "describe": impl.describe()}
report["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
report["our_kernels"] = [m for m in sys.modules if m.startswith("pagedbench.kernels")]
print(json.dumps(report))
"""


def _peers_python() -> Path:
    if not PEERS_PYTHON.exists():
        pytest.skip("no peers venv (make peers)")
    probe = subprocess.run(
        [str(PEERS_PYTHON), "-c", "import pagedbench.conformance.peers"], capture_output=True, cwd=ROOT, timeout=120
    )
    if probe.returncode != 0:
        pytest.skip("the peers venv has no pagedbench (make peers installs it)")
    return PEERS_PYTHON


def test_each_adapter_matches_the_oracle_in_the_peers_venv():
    python = _peers_python()
    run = subprocess.run(
        [str(python), "-c", SCRIPT, json.dumps(ADAPTERS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["our_kernels"] == []  # the outside adapters never load ours
    for name in ADAPTERS:
        assert report[name]["max_abs_err"] < 1e-2, (name, report[name])
        described = report[name]["describe"]
        assert all(described["peer"].values()), described  # the peer's version is recorded
        assert described["triton_interpret"] == (report["TRITON_INTERPRET"] == "1"), described
