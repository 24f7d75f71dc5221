"""The decode sweep ranks only plans that agree with the float64 reference (run under the interpreter)."""

import time

import torch
from pagedbench.bench.studies.kernels import decode_sweep
from pagedbench.bench.studies.kernels import study as kernel_study
from pagedbench.kernels import attention

TINY = kernel_study.Workload(2, 40, 4, 4, 2, 16, "float32")


def _plan(block_g: int, block_n: int, splits: int) -> attention.DecodePlan:
    return attention.DecodePlan(attention.DecodeTiles(block_g, block_n, 16, 4, False), splits)


def test_sweep_times_correct_plans_and_never_ranks_a_wrong_one():
    good = [decode_sweep.Candidate(True, _plan(2, n, s)) for s in (1, 3) for n in (8, 16)]
    good.append(decode_sweep.Candidate(False, _plan(2, 8, 2)))
    wrong = decode_sweep.Candidate(True, _plan(1, 8, 1))  # half of each GQA group never computed
    timed = []

    def timer(fn):
        timed.append(fn)
        return 1.0 + len(timed)

    res = decode_sweep.sweep_workload(TINY, [wrong, *good], timer, time.monotonic() + 600, torch.device("cpu"))
    rows = res["rows"]
    assert [r["correct"] for r in rows] == [False] + [True] * len(good)
    assert "ms" not in rows[0] and all("ms" in r for r in rows[1:])
    assert decode_sweep.best(rows, paged=True)["label"] == good[0].label
    assert decode_sweep.best(rows, paged=False)["label"] == good[-1].label
    assert set(res["default_ms"]) == {"paged", "contiguous"}


def test_sweep_stops_starting_plans_at_its_deadline():
    cands = [decode_sweep.Candidate(True, _plan(2, 8, 1))] * 3
    res = decode_sweep.sweep_workload(TINY, cands, lambda fn: 1.0, time.monotonic() - 1, torch.device("cpu"))
    assert res["rows"] == [] and res["not_run_past_time_limit"] == 3
