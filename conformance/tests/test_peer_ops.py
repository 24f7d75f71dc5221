"""vLLM's prefix-prefill, cache-write and merge adapters and SGLang's merge adapter in the peers venv
(``make peers``): a tiny prefill over a cached context against the float64 oracle, a cache write through a
shuffled slot mapping with a padding slot, against the slots it must and must not touch, and merges of two
finite parts against the float64 merge; each records its peer's version.

Skipped where that venv is absent or lacks pagedbench, like ``test_peer_adapters``.
"""

from __future__ import annotations

import json
import subprocess

from pagedbench.conformance.tests.test_peer_adapters import ROOT, _peers_python

SCRIPT = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
from dataclasses import replace
from pagedbench.conformance import registry
from pagedbench.conformance.gate import builders
from pagedbench.conformance.gate.cases import AttentionCase
import pagedbench.conformance.peers.vllm_prefill, pagedbench.conformance.peers.vllm_cache_write
import pagedbench.conformance.peers.vllm_merge, pagedbench.conformance.peers.sglang_merge
report = {}

prefill = registry.get("vllm-prefill")
case = AttentionCase("prefill", block_size=16, seq_lens=(21, 40), q_lens=(5, 17), num_heads=4, num_kv_heads=2,
                     head_dim=32)
x = builders.build(case)
out = prefill.paged_prefill(x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens, x.cu_seqlens_q, scale=x.scale)
ref = builders.expected(case, x)
report["prefill"] = {"max_abs_err": float((out.double() - ref.out).abs().max()), "describe": prefill.describe()}

write = registry.get("vllm-cache-write")
gen = torch.Generator().manual_seed(3)
k, v = (torch.randn(5, 2, 32, generator=gen, dtype=torch.float32).half() for _ in range(2))
k_cache, v_cache = (torch.full((4, 16, 2, 32), float("nan"), dtype=torch.float16) for _ in range(2))
slots = torch.tensor([37, 2, -1, 63, 16], dtype=torch.int64)  # -1: a padding token, written nowhere
write.write_kv(k, v, k_cache, v_cache, slots)
flat_k, flat_v = k_cache.view(64, 2, 32), v_cache.view(64, 2, 32)
kept = [i for i, s in enumerate(slots.tolist()) if s >= 0]
report["write"] = {
    "written_right": all(torch.equal(flat_k[slots[i]], k[i]) and torch.equal(flat_v[slots[i]], v[i]) for i in kept),
    "untouched_nan": int(flat_k.isnan().all(-1).all(-1).sum()),
    "describe": write.describe(),
}
out_a, out_b = (torch.randn(3, 4, 32, generator=gen) for _ in range(2))
lse_a, lse_b = (torch.randn(3, 4, generator=gen) * 3 for _ in range(2))
want = torch.logaddexp(lse_a.double(), lse_b.double())
want_out = (lse_a.double() - want).exp()[..., None] * out_a + (lse_b.double() - want).exp()[..., None] * out_b
for name in ("vllm-merge", "sglang-merge"):
    merge = registry.get(name)
    out, lse = merge.merge_attn_states(out_a, lse_a, out_b, lse_b)
    report[name] = {"out_err": float((out.double() - want_out).abs().max()),
                    "lse_err": float((lse.double() - want).abs().max()), "describe": merge.describe()}
report["our_kernels"] = [m for m in sys.modules if m.startswith("pagedbench.kernels")]
print(json.dumps(report))
"""


def test_prefill_cache_write_and_merge_adapters_in_the_peers_venv():
    python = _peers_python()
    run = subprocess.run(
        [str(python), "-c", SCRIPT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["our_kernels"] == []
    assert report["prefill"]["max_abs_err"] < 1e-2, report["prefill"]
    assert report["write"]["written_right"], report["write"]
    assert report["write"]["untouched_nan"] == 64 - 4  # the 4 written slots, and none for the padding token
    for part in ("vllm-merge", "sglang-merge"):
        assert report[part]["out_err"] < 1e-5 and report[part]["lse_err"] < 1e-5, report[part]
    for part in ("prefill", "write", "vllm-merge", "sglang-merge"):
        assert all(report[part]["describe"]["peer"].values()), report[part]
