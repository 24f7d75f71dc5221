"""Fast-forwarded simulation makes step-by-step simulation's schedule: every step's shape and time, every
request's finish, the preemptions and the block manager's state and statistics."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pagedbench.bench import workloads
from pagedbench.bench.sim import simulator as serving_sim
from pagedbench.bench.sim.run import SimRun, default_manager
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.bench.workloads import Request, trace_formats
from pagedbench.refengine.engine.core import EngineCore


def _mooncake_like(n: int, seed: int) -> tuple[Request, ...]:
    """Prompts of 1-4 blocks of 512 tokens drawn from a few shared prefixes (as Mooncake's hash ids)."""
    rng = np.random.default_rng(seed)
    out, t, next_id = [], 0.0, 100
    for i in range(n):
        t += float(rng.exponential(0.15))
        num_blocks = int(rng.integers(1, 5))
        ids = [int(rng.integers(0, 3)), *range(next_id, next_id + num_blocks - 1)]
        next_id += num_blocks
        prompt = 512 * (num_blocks - 1) + int(rng.integers(1, 513))
        out.append(Request(i, prompt, int(rng.integers(5, 300)), t, tuple(ids)))
    return tuple(out)


def _run(trace, spec, cfg, fast: bool, monkeypatch, **kw):
    shapes, managers, steps = [], [], [0]

    def step_time_s(shape) -> float:  # depends on the whole shape, so any change moves the clock
        shapes.append(shape)
        return 0.004 + 1e-6 * sum(shape.decode_context_lens) + 3e-6 * shape.num_prefill_tokens

    def manager(spec, cfg):
        managers.append(default_manager(spec, cfg))
        return managers[-1]

    real_step = EngineCore.step

    def counting_step(self):
        steps[0] += 1
        return real_step(self)

    monkeypatch.setattr(EngineCore, "step", counting_step)
    result = simulate(trace, spec, cfg, step_time_s=step_time_s, account=False, make_manager=manager,
                      fast_forward=fast, **kw)
    (bm,) = managers
    return result, shapes, bm, steps[0]


def _check_identical(trace, spec, cfg, monkeypatch, max_steps_share=1 / 3, **kw):
    slow, slow_shapes, slow_bm, slow_steps = _run(trace, spec, cfg, False, monkeypatch, **kw)
    fast, fast_shapes, fast_bm, fast_steps = _run(trace, spec, cfg, True, monkeypatch, **kw)
    assert fast_shapes == slow_shapes  # the schedule, step by step
    assert fast == slow  # finish times (latencies), preemptions, steps, clock, tokens
    assert fast_bm.metrics() == slow_bm.metrics()
    if hasattr(slow_bm, "free_block_ids"):  # the pool's order: the same blocks, the same ids
        assert fast_bm.free_block_ids() == slow_bm.free_block_ids()
    assert slow.num_finished == len(trace)
    assert fast_steps < slow_steps * max_steps_share, (fast_steps, slow_steps)  # it did skip steps
    return slow, slow_bm


@pytest.mark.parametrize("policy", ["mixed", "separate"])
def test_identical_on_a_trace_that_preempts(policy, monkeypatch):
    trace = workloads.synthetic("sharegpt", 120, rate=40.0, seed=1, max_seq_len=1024)
    cfg = SimConfig(kv_slots=3000, max_seq_len=1024, policy=policy, max_num_seqs=64)
    result, _ = _check_identical(trace, AllocatorSpec("paged", 16), cfg, monkeypatch)
    assert result.num_preemptions > 10


def test_identical_with_prefix_sharing_and_preemption(monkeypatch):
    trace = _mooncake_like(80, seed=2)
    cfg = SimConfig(kv_slots=9000, max_seq_len=4096, enable_prefix_caching=True, max_num_seqs=32)
    # behind a refused head a run ends where it publishes the block the head's hits would go on with
    result, bm = _check_identical(trace, AllocatorSpec("paged", 16), cfg, monkeypatch, max_steps_share=0.5,
                                  prompt_tokens=trace_formats.prompt_token_ids)
    assert bm.metrics().prefix_hit_tokens > 0 and result.num_preemptions > 0


def test_identical_when_runs_evict_blocks_their_twins_replace(monkeypatch):
    # two prompts only, in a small pool: the cache holds earlier requests' decode blocks (all filler),
    # which a run may evict while a running request publishes the same block (a twin), so the run's
    # publications must keep their places between its takes
    rng = np.random.default_rng(0)
    trace, t = [], 0.0
    for i in range(60):
        t += float(rng.exponential(0.005))
        prompt = (int(rng.integers(0, 2)),)  # a Mooncake hash id: one of two 40-token prompts
        trace.append(Request(i, 40, int(rng.integers(20, 120)), t, prompt))
    cfg = SimConfig(kv_slots=1200, max_seq_len=512, enable_prefix_caching=True, max_num_seqs=16)
    _, bm = _check_identical(tuple(trace), AllocatorSpec("paged", 16), cfg, monkeypatch, max_steps_share=0.5,
                             prompt_tokens=trace_formats.prompt_token_ids)
    assert bm.metrics().evictions > 0 and bm.metrics().prefix_hit_tokens > 0


@pytest.mark.parametrize("policy", ["max", "pow2"])
def test_identical_with_orca_reservations(policy, monkeypatch):
    trace = workloads.synthetic("sharegpt", 60, rate=20.0, seed=3, max_seq_len=512)
    cfg = SimConfig(kv_slots=4096, max_seq_len=512, max_num_seqs=16)
    _check_identical(trace, AllocatorSpec("orca", 1, policy), cfg, monkeypatch)


def test_no_fast_forward_past_the_window_without_drain(monkeypatch):
    trace = workloads.synthetic("sharegpt", 40, rate=20.0, seed=4, max_seq_len=512)
    cfg = SimConfig(kv_slots=8000, max_seq_len=512, drain=False)
    slow, *_ = _run(trace, AllocatorSpec("paged", 16), cfg, False, monkeypatch)
    fast, *_ = _run(trace, AllocatorSpec("paged", 16), cfg, True, monkeypatch)
    assert fast == slow and slow.num_finished < len(trace)


def test_on_step_is_called_after_each_run_with_the_sequences_told(monkeypatch):
    # without on_step a call of the run's step serves runs one after another; with it, one run a call, and
    # the running sequences hold every token (no decode session keeps them lazy)
    from pagedbench.bench.sim.fast_forward import FastForward

    trace = _eventful(120, 1, 4)
    cfg = SimConfig(kv_slots=240, max_seq_len=80, max_num_seqs=24, watermark=0.05, step_s=0.01)
    runs, managers = [0], []
    real_advance = FastForward.advance

    def counting(self, run):
        done = real_advance(self, run)
        runs[0] += done is not None
        return done

    def manager(spec, cfg):
        managers.append(default_manager(spec, cfg))
        return managers[-1]

    monkeypatch.setattr(FastForward, "advance", counting)
    calls, told = [0], []

    def on_step():
        calls[0] += 1
        (bm,) = managers
        sched = scheds[0]
        told.append(all(s.num_computed_tokens == len(s.token_ids) - 1 == bm.num_tokens(s.seq_id)
                        for s in sched.running if s.num_computed_tokens))

    scheds = []
    real_init = SimRun.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        scheds.append(self.sched)

    monkeypatch.setattr(SimRun, "__init__", init)
    with_calls = simulate(trace, AllocatorSpec("paged", 4), cfg, account=False, make_manager=manager, on_step=on_step)
    assert runs[0] > 20 and calls[0] >= runs[0] and all(told)
    runs[0] = 0
    managers.clear()
    scheds.clear()
    chained = []
    real_step = SimRun.step

    def counting_steps(self):
        chained.append(1)
        return real_step(self)

    monkeypatch.setattr(SimRun, "step", counting_steps)
    assert simulate(trace, AllocatorSpec("paged", 4), cfg, account=False, make_manager=manager) == with_calls
    assert len(chained) < runs[0] / 2  # (the runs one after another in a call)


def test_accounting_runs_step_by_step():
    trace = workloads.synthetic("sharegpt", 10, seed=5, max_seq_len=512)
    cfg = SimConfig(kv_slots=8000, max_seq_len=512)
    a = simulate(trace, AllocatorSpec("paged", 16), cfg, fast_forward=True, record_steps=True)
    b = simulate(trace, AllocatorSpec("paged", 16), cfg, fast_forward=False, record_steps=True)
    assert a == b and len(a.steps) == a.num_steps


def test_append_tokens_matches_one_call_per_token():
    from pagedbench.refengine import BlockManager
    from pagedbench.refengine.errors import InvalidArgumentError, OutOfBlocksError

    one, bulk = BlockManager(8, 4, enable_prefix_caching=True), BlockManager(8, 4, enable_prefix_caching=True)
    for bm in (one, bulk):
        bm.allocate(0, [1, 2, 3])
    for t in [5, 6, 7, 8, 9, 10]:
        one.append_token(0, t)
    bulk.append_tokens(0, [5, 6, 7, 8, 9, 10])
    assert bulk.block_table(0) == one.block_table(0) and bulk.metrics() == one.metrics()
    assert bulk.token_ids(0) == one.token_ids(0) and bulk.free_block_ids() == one.free_block_ids()
    with pytest.raises(OutOfBlocksError, match="needs 6 new blocks for 24 tokens but only 5 are free"):
        bulk.append_tokens(0, [1] * 24)
    assert bulk.metrics() == one.metrics()  # a refused call changes nothing
    bulk.fork(0, 1)
    with pytest.raises(InvalidArgumentError, match="shares its last block"):
        bulk.append_tokens(1, [1])


def test_simresult_is_comparable():
    # the identity checks compare SimResults whole: every field must take part in equality
    assert all(f.compare for f in dataclasses.fields(serving_sim.SimResult))


def test_record_refused_allocations_counts_as_refused_calls():
    from pagedbench.refengine import BlockManager, ContiguousBlockManager
    from pagedbench.refengine.errors import InvalidArgumentError

    for bm in (BlockManager(2, 4), ContiguousBlockManager(8, 1, max_seq_len=8)):
        bm.record_refused_allocations(3)
        assert bm.metrics().failed_allocations == 3
        with pytest.raises(InvalidArgumentError, match="count must be an int >= 0, got -1"):
            bm.record_refused_allocations(-1)


def _roofline():
    from pagedbench.bench.costmodel.hardware import load_hardware
    from pagedbench.bench.costmodel.models import load_model
    from pagedbench.bench.costmodel.step_cost import StepCostModel
    from pagedbench.bench.sim.points import step_time_fn

    return step_time_fn(StepCostModel.from_profiles(load_model("opt-13b"), load_hardware("a100-40gb")))


def test_decode_run_gives_each_steps_duration_as_its_shape_does():
    from pagedbench.bench.sim.fast_forward import decode_run_of
    from pagedbench.refengine.engine.core import StepShape

    rng = np.random.default_rng(6)
    plain = lambda shape: 0.001 + 1e-7 * sum(shape.decode_context_lens) ** 1.5  # noqa: E731 (no decode_run)
    for fn in (_roofline(), serving_sim.constant_step(0.03), plain):
        for _ in range(20):
            ctx = tuple(int(c) for c in rng.integers(1, 4000, int(rng.integers(1, 300))))
            run = decode_run_of(fn)(ctx)
            for j in (0, 1, int(rng.integers(2, 500))):
                assert run(j) == fn(StepShape((), tuple(c + j for c in ctx)))  # the same float


@pytest.mark.parametrize("rate", [10.0, 40.0])
def test_identical_with_the_roofline_step_time(rate):
    trace = workloads.synthetic("sharegpt", 120, rate=rate, seed=7, max_seq_len=1024)
    cfg = SimConfig(kv_slots=3000, max_seq_len=1024, max_num_seqs=64)
    managers, runs = [], []

    def manager(spec, cfg):
        managers.append(default_manager(spec, cfg))
        return managers[-1]

    for fast in (False, True):
        r = simulate(trace, AllocatorSpec("paged", 16), cfg, step_time_s=_roofline(), account=False,
                     make_manager=manager, fast_forward=fast)
        runs.append((r, managers[-1].metrics(), managers[-1].free_block_ids()))
    assert runs[1] == runs[0] and runs[0][0].num_finished == len(trace)


def test_a_run_behind_a_refused_head_ends_where_a_publication_could_give_it_a_hit():
    from pagedbench.bench.sim.fast_forward import FastForward

    ff = object.__new__(FastForward)
    ff.bs = 16
    ff.hit_blocks = (2, 100)  # hits on blocks 0 and 1; block 2 (tokens 32-47) could be one
    # a table of 40 tokens holds 41 after step 0, 48 after step 7: block 2 is published at step 7's end
    assert ff._bound_by_new_hits([40, 10], 30) == 8 and ff._bound_by_new_hits([40], 8) == 8
    assert ff._bound_by_new_hits([48, 60], 30) == 30  # past block 2 already
    ff.hit_blocks = (6, 100)  # (100 - 1) // 16 = 6 blocks are every hit a lookup may give
    assert ff._bound_by_new_hits([100], 30) == 30


@pytest.mark.parametrize("stop", [False, True])
def test_identical_with_a_span_cool_down_and_the_overload_stop(stop, monkeypatch):
    # the overload test reads every step: a run ends with the step that ends past the window, and (with
    # stop_on_overload) with each step an arrival preceded, where step-by-step simulation may stop
    trace = workloads.synthetic("sharegpt", 150, rate=30.0, seed=8, max_seq_len=1024)
    span = trace[-1].arrival_s + 0.01
    cfg = SimConfig(kv_slots=3000, max_seq_len=1024, max_num_seqs=64, span_s=span, cooldown_frac=0.3,
                    stop_on_overload=stop)
    slow, slow_shapes, slow_bm, slow_steps = _run(trace, AllocatorSpec("paged", 16), cfg, False, monkeypatch)
    fast, fast_shapes, fast_bm, fast_steps = _run(trace, AllocatorSpec("paged", 16), cfg, True, monkeypatch)
    assert fast_shapes == slow_shapes and fast == slow and fast_bm.metrics() == slow_bm.metrics()
    assert slow.overload.overloaded and slow.overload.stopped_early == stop
    assert fast_steps < slow_steps / 3


@pytest.mark.parametrize("step_s", [0.03, 0.07])
def test_a_span_ends_at_the_first_step_past_the_window_when_every_measured_request_is_done(step_s):
    # the window is [1, 7]: the requests arriving in it are done well before 7, while a warm-up request and
    # the cool-down's keep decoding across its end; step-by-step simulation stops after the first step
    # ending past it (the overload test closes the window with nothing measured left), a run completing
    # nothing there included
    trace = (Request(0, 20, 400, 0.5), *(Request(i, 10, 5, 1.0 + 0.5 * i) for i in range(1, 11)),
             Request(11, 20, 300, 7.5), Request(12, 20, 300, 8.0))
    cfg = SimConfig(kv_slots=4096, max_seq_len=1024, span_s=10.0, cooldown_frac=0.3, step_s=step_s)
    slow, fast = (simulate(trace, AllocatorSpec("paged", 16), cfg, account=False, fast_forward=ff) for ff in (0, 1))
    assert fast == slow and 7.0 < slow.simulated_s <= 7.0 + step_s and slow.num_finished == 10


def _eventful(n: int, seed: int, block_size: int) -> tuple[Request, ...]:
    """Short prompts and outputs (one token often) arriving fast into a small pool: steps that finish,
    preempt and admit at once, and preemptions that free a block the same step's later takes need."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for i in range(n):
        t += float(rng.exponential(0.004))
        prompt = int(rng.integers(1, 4 * block_size))
        output = 1 if rng.random() < 0.25 else int(rng.integers(1, 16 * block_size))
        out.append(Request(i, prompt, output, t))
    return tuple(out)


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_identical_on_eventful_traces(block_size, seed, monkeypatch):
    trace = _eventful(150, seed, block_size)
    cfg = SimConfig(kv_slots=60 * block_size, max_seq_len=20 * block_size, max_num_seqs=24, watermark=0.05)
    result, _ = _check_identical(trace, AllocatorSpec("paged", block_size), cfg, monkeypatch, max_steps_share=0.5)
    assert result.num_preemptions > 20


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("spec,policy", [(AllocatorSpec("paged", 4), "separate"), (AllocatorSpec("orca", 1), "mixed")])
def test_identical_on_eventful_traces_without_the_session(spec, policy, seed, monkeypatch):
    # the separate policy and Orca's reservations: runs that end with a finish (or, paged, a preemption)
    trace = _eventful(150, seed, 4)
    cfg = SimConfig(kv_slots=240, max_seq_len=80, max_num_seqs=24, watermark=0.05, policy=policy)
    result, _ = _check_identical(trace, spec, cfg, monkeypatch, max_steps_share=0.5)
    # (Max reserves each request's whole length: it never preempts)
    assert result.num_preemptions > 5 if spec.kind == "paged" else result.num_finished == len(trace)


def test_identical_with_prompts_longer_than_a_steps_budget(monkeypatch):
    # chunked prefill: an admitted prompt the step's budget cuts keeps the session from taking it in
    trace = _eventful(150, 3, 4)
    cfg = SimConfig(kv_slots=240, max_seq_len=80, max_num_seqs=24, max_num_batched_tokens=24, watermark=0.05)
    result, _ = _check_identical(trace, AllocatorSpec("paged", 4), cfg, monkeypatch, max_steps_share=0.5)
    assert result.num_preemptions > 5


@pytest.mark.parametrize("case", ["eventful", "span_stop", "span_drain"])
def test_identical_with_a_constant_step_time(case):
    # a constant step time (the sim_speed study's) lets the session skip the shapes and add up one float
    if case == "eventful":
        trace = _eventful(200, 4, 16)
        cfg = SimConfig(kv_slots=60 * 16, max_seq_len=20 * 16, max_num_seqs=24, watermark=0.05, step_s=0.003)
    else:
        trace = workloads.synthetic("sharegpt", 150, rate=30.0, seed=8, max_seq_len=1024)
        cfg = SimConfig(kv_slots=3000, max_seq_len=1024, max_num_seqs=64, span_s=trace[-1].arrival_s + 0.01,
                        cooldown_frac=0.3, stop_on_overload=case == "span_stop", step_s=0.03)
    managers, runs = [], []

    def manager(spec, cfg):
        managers.append(default_manager(spec, cfg))
        return managers[-1]

    for fast in (False, True):
        r = simulate(trace, AllocatorSpec("paged", 16), cfg, account=False, make_manager=manager, fast_forward=fast)
        runs.append((r, managers[-1].metrics(), managers[-1].free_block_ids()))
    assert runs[1] == runs[0]
    assert runs[0][0].num_preemptions > 5 if case == "eventful" else runs[0][0].overload.overloaded
