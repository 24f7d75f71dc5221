"""The dispatch switches the outside adapters declare are where their installed kernels switch.

In the peers venv (``make peers``), each declared boundary's cases (``test_dispatch_boundaries.cases_around``)
go through the adapter with the peer's launches replaced by recorders (nothing runs): the path or tile
each case got must differ between N-1 and N. A new release that moves a rule fails here rather than
leaving the family testing both sides of a switch that is no longer there. Skipped where that venv is
absent, like ``test_peer_adapters``.
"""

from __future__ import annotations

import json
import subprocess

from pagedbench.conformance.tests.test_peer_adapters import ROOT, _peers_python

SCRIPT = """
import json, warnings
warnings.simplefilter("ignore")
from pagedbench.conformance import registry
from pagedbench.conformance.gate import builders
from pagedbench.conformance.peers import sglang_decode, vllm_paged_decode, vllm_unified
from pagedbench.conformance.suite.test_dispatch_boundaries import KINDS, cases_around


class Launch:
    # kernel[grid](...) records the grid's rank and the constexprs asked for, and runs nothing
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *a, **kw: self.log.append({"rank": len(grid) if isinstance(grid, tuple) else -1, **{
            k: v for k, v in kw.items()
            if (k.isupper() or k.endswith("_padded")) and isinstance(v, (int, float, str, type(None)))}})


def path(impl, case, log):
    log.clear()
    x = builders.build(case, impl.device)
    builders.call(impl, case, x)
    return log[0] if log else None


report = {}
log = []
unified = vllm_unified.load()
unified.kernel_unified_attention = Launch(log)
unified.reduce_segments = Launch([])
paged = vllm_paged_decode.load()
paged.kernel_paged_attention_2d = Launch(log)
sglang = sglang_decode.load()
sglang.decode_attention_fwd_normal = lambda *a, **kw: log.append({"kernel": "normal"})
# the grouped kernel's head tiles per KV head: cur_kv_head = cur_head_id // cdiv(kv_group_num, BLOCK_H)
sglang.decode_attention_fwd_grouped = lambda q, k, *a, **kw: log.append(
    {"kernel": "grouped", "tiles_per_kv_head": -(-(q.shape[1] // k.shape[-2]) // sglang._GROUPED_BLOCK_H)})
for name in ("vllm-unified", "vllm-paged-decode", "sglang-decode"):
    impl = registry.get(name)
    declared = impl.capabilities.dispatch_boundaries
    report[name] = {kind: {str(b): [[case.id, path(impl, case, log)] for case in cases_around(kind, b)]
                           for b in getattr(declared, kind)} for kind in KINDS}
print(json.dumps(report))
"""


def _run() -> dict:
    python = _peers_python()
    run = subprocess.run([str(python), "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _sides(cases: list) -> tuple:
    """(what N-1 got, what N got); with context_lens each length has a decode and a prefill case."""
    step = len(cases) // 3
    return cases[0][1], cases[step][1]


def test_declared_switches_are_where_the_installed_kernels_switch():
    report = _run()
    unified = report["vllm-unified"]
    below, at = _sides(unified["decode_batch_sizes"]["65"])
    assert (below["rank"], at["rank"]) == (3, 2), unified["decode_batch_sizes"]  # split-K (3-D) up to 64 rows
    below, at = _sides(unified["query_lens"]["9"])
    assert (below["rank"], at["rank"]) == (3, 2), unified["query_lens"]  # 3-D for chunks of up to 8
    below, at = _sides(unified["gqa_groups"]["17"])
    assert (below["BLOCK_M"], at["BLOCK_M"]) == (16, 32), unified["gqa_groups"]
    for (case_id, got) in unified["context_lens"]["257"]:
        # every case 3-D, and 16 segments of TILE_SIZE keys cover 256: one tile each up to 256 keys
        assert got["rank"] == 3 and got["NUM_SEGMENTS_PER_SEQ"] * got["TILE_SIZE"] == 256, (case_id, got)
    paged = report["vllm-paged-decode"]
    below, at = _sides(paged["gqa_groups"]["17"])
    assert (below["num_queries_per_kv_padded"], at["num_queries_per_kv_padded"]) == (16, 32), paged
    sglang = report["sglang-decode"]["gqa_groups"]
    assert [got["kernel"] for _, got in sglang["2"]] == ["normal", "grouped", "grouped"], sglang
    assert [got["tiles_per_kv_head"] for _, got in sglang["17"]] == [1, 2, 2], sglang
