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


SWITCH_SCRIPT = """
import json, math, warnings
warnings.simplefilter("ignore")
from pagedbench.conformance import registry
from pagedbench.conformance.gate import builders
from pagedbench.conformance.gate.cases import AttentionCase
import pagedbench.conformance.peers.vllm_unified as vu
impl = registry.get("vllm-unified")
inner, split = impl._kernel, []
def watched(*args, **kwargs):  # the 3-D (split-K) launch is the one that writes the segment scratch
    kwargs["softmax_segm_max"].fill_(math.nan)
    inner(*args, **kwargs)
    split.append(not bool(kwargs["softmax_segm_max"].isnan().all()))
impl._kernel = watched
n = vu.DISPATCH.decode_batch_sizes[0]
for num_seqs in (n - 1, n):
    case = AttentionCase("decode", block_size=16, seq_lens=(3,) * num_seqs, num_heads=4, num_kv_heads=2, head_dim=32)
    builders.call(impl, case, builders.build(case, impl.device))
print(json.dumps({"boundary": n, "split_k": split}))
"""


def test_vllm_unified_declared_batch_switch_is_where_its_launcher_switches():
    """The decode batch size declared in vllm-unified's dispatch_boundaries is the first the 2-D kernel takes:
    one sequence fewer still takes the 3-D (split-K) one, so the family's cases sit on both sides of it."""
    python = _peers_python()
    run = subprocess.run([str(python), "-c", SWITCH_SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["split_k"] == [True, False], report
