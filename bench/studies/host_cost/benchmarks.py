"""pytest-benchmark functions of the host-cost study; :func:`bench.studies.host_cost.study.main` runs them.

Not part of ``make test`` (benchmarks measure, tests check). Standalone, on the default config:
``.venv/bin/python -m pytest bench/studies/host_cost/benchmarks.py -o python_files='*.py'``. Every function
times one measurement of :data:`bench.studies.host_cost.study.MEASUREMENTS` for one variant; the manager and the
token lists are built in ``setup``, outside the timed region, fresh for every round.
"""

from __future__ import annotations

import pytest
from pagedbench.bench.studies.host_cost import study as host_cost
from pagedbench.refengine import BlockManager

CFG = host_cost.active_config()
VARIANTS = {v.name: v for v in CFG.variants}
_WORKLOADS: dict[str, host_cost.Workload] = {}


def _workload(name: str) -> host_cost.Workload:
    if name not in _WORKLOADS:
        _WORKLOADS[name] = host_cost.build_workload(CFG, VARIANTS[name])
    return _WORKLOADS[name]


def _manager(name: str) -> BlockManager:
    return BlockManager(_workload(name).num_blocks, CFG.block_size,
                        enable_prefix_caching=VARIANTS[name].prefix_caching)


def _admitted(name: str) -> BlockManager:
    bm = _manager(name)
    for i, p in enumerate(_workload(name).prompts):
        bm.allocate(i, p)
    return bm


def _decode(bm: BlockManager, decode_tokens: tuple[list[int], ...]) -> None:
    """One append_token per sequence per step: the timed loop of ``decode``."""
    append = bm.append_token
    for step_tokens in decode_tokens:
        for i, t in enumerate(step_tokens):
            append(i, t)


def _scheduler_steps(bm: BlockManager, decode_tokens: tuple[list[int], ...]) -> None:
    """Per step and sequence: can_append, append_token (collecting copies), slot of the new token."""
    append, can_append, slot = bm.append_token, bm.can_append, bm.slot
    positions = [bm.num_tokens(i) for i in range(len(decode_tokens[0]))]
    for step_tokens in decode_tokens:
        copies: list[tuple[int, int]] = []
        slots = []
        for i, t in enumerate(step_tokens):
            if not can_append(i):
                raise RuntimeError(f"sequence {i} cannot append: the pool is sized too small")
            copies += append(i, t)
            slots.append(slot(i, positions[i]))
            positions[i] += 1


def _free_all(bm: BlockManager, num_seqs: int) -> None:
    free = bm.free
    for i in range(num_seqs):
        free(i)


def _run(benchmark, name: str, measurement: str, units: int, target, setup) -> None:
    benchmark.extra_info.update(variant=name, measurement=measurement, units_per_round=units)
    benchmark.pedantic(target, setup=setup, rounds=CFG.rounds, warmup_rounds=1, iterations=1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_admission(benchmark, name):
    w = _workload(name)

    def admit(bm):
        allocate = bm.allocate
        for i, p in enumerate(w.prompts):
            allocate(i, p)

    _run(benchmark, name, "admission", len(w.prompts), admit, lambda: ((_manager(name),), {}))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode(benchmark, name):
    w = _workload(name)
    _run(benchmark, name, "decode", CFG.decode_steps * CFG.batch, lambda bm: _decode(bm, w.decode_tokens),
         lambda: ((_admitted(name),), {}))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_step(benchmark, name):
    w = _workload(name)
    _run(benchmark, name, "step", CFG.decode_steps, lambda bm: _scheduler_steps(bm, w.decode_tokens),
         lambda: ((_admitted(name),), {}))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_free(benchmark, name):
    w = _workload(name)

    def setup():
        bm = _admitted(name)
        _decode(bm, w.decode_tokens)
        return (bm,), {}

    _run(benchmark, name, "free", len(w.prompts), lambda bm: _free_all(bm, len(w.prompts)), setup)
