"""The cost of waking an idle engine: its interpolation, and the simulator charging it to exactly the steps
after each idle jump of its clock (against the real-time loop on an engine whose steps after a wait last that
much longer)."""

from __future__ import annotations

import dataclasses

import pytest
from pagedbench.bench.costmodel.wake_cost import WakeCost, with_wake
from pagedbench.bench.sim.run import default_manager
from pagedbench.bench.sim.simulator import AllocatorSpec, constant_step
from pagedbench.bench.studies.calibrate import online as calibrate_online
from pagedbench.bench.studies.calibrate.config import CONFIG, load_config
from pagedbench.bench.studies.calibrate.online import StepLog, serve_online, serve_simulated_online, step_error
from pagedbench.bench.tests.test_calibrate_online import STEP_S, _trace
from pagedbench.refengine.engine.core import EngineCore, SimClock, SimulatedExecutor
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule

WAKE = WakeCost((0.25, 1.0), ((1 / 256, 1 / 1024, 0.0), (1 / 64, 1 / 256, 1 / 1024)), pickup_s=(1 / 2048, 1 / 512))


def test_interpolates_from_zero_between_the_measured_waits_and_holds_past_the_last() -> None:
    assert WAKE(0.0) == WAKE(-1.0) == (0.0, 0.0, 0.0)
    assert WAKE(0.125) == pytest.approx((1 / 512, 1 / 2048, 0.0))  # half way from (0, 0) to the first wait
    assert WAKE(0.25) == pytest.approx((1 / 256, 1 / 1024, 0.0))
    assert WAKE(0.625) == pytest.approx(((1 / 256 + 1 / 64) / 2, (1 / 1024 + 1 / 256) / 2, 1 / 2048))
    assert WAKE(1.0) == WAKE(30.0) == pytest.approx((1 / 64, 1 / 256, 1 / 1024))
    assert WakeCost((0.1,), ((-0.002,),))(0.5) == (0.0,)  # a wait measured faster than warm (noise) costs nothing
    # the pick-up: none without a wait, interpolated between the waits, held outside them
    assert WAKE.pickup(0.0) == 0.0 and WAKE.pickup(0.1) == WAKE.pickup(0.25) == pytest.approx(1 / 2048)
    assert WAKE.pickup(0.625) == pytest.approx((1 / 2048 + 1 / 512) / 2) and WAKE.pickup(9.0) == pytest.approx(1 / 512)
    assert WakeCost(WAKE.gaps_s, WAKE.extra_s).pickup(0.5) == 0.0  # a record from before it was measured


def test_measured_takes_the_median_extra_per_wait_and_step_and_round_trips() -> None:
    w = WakeCost.measured([0.02, 0.1], [[[(1.0, 1.5), (1.0, 1.1), (2.0, 2.3)], [(1.0, 1.0), (1.0, 1.2), (1.0, 1.1)]],
                                        [[(1.0, 2.0)], [(1.0, 1.05)]]], [[0.001, 0.003, 0.002], [-0.001]])
    assert w.extra_s == (pytest.approx((0.3, 0.1)), pytest.approx((1.0, 0.05))) and w.num_steps == 2
    assert w.pickup_s == (pytest.approx(0.002), 0.0)  # a timer that read early picked up at once
    assert WakeCost.from_record(w.to_record()) == w


@pytest.mark.parametrize(("gaps", "extra", "match"), [
    ((), (), "one row of extra times per gap"), ((0.1, 0.2), ((0.0,),), "one row of extra times per gap"),
    ((0.2, 0.1), ((0.0,), (0.0,)), "strictly increasing"), ((0.0,), ((0.1,),), "> 0"),
    ((0.1, 0.2), ((0.0,), (0.0, 0.0)), "same number"), ((0.1,), ((),), "same number"),
])
def test_refuses_bad_waits(gaps, extra, match) -> None:
    with pytest.raises(ValueError, match=match):
        WakeCost(gaps, extra)


def test_refuses_bad_pickups() -> None:
    with pytest.raises(ValueError, match="one pick-up time >= 0 per gap"):
        WakeCost((0.1, 0.2), ((0.0,), (0.0,)), pickup_s=(0.001,))
    with pytest.raises(ValueError, match="one pick-up time >= 0 per gap"):
        WakeCost((0.1,), ((0.0,),), pickup_s=(-0.001,))
    with pytest.raises(ValueError, match="non-empty pick-up times per gap"):
        WakeCost.measured([0.1], [[[(1.0, 1.1)]]], [[]])


def _waking_core(spec, state: dict) -> EngineCore:
    """A stub engine: every step lasts STEP_S, and the i-th after the loop's idle wait of g seconds lasts
    STEP_S + WAKE(g)[i] (``state['extra']``, set by :func:`_wait`)."""
    sim_cfg = calibrate_online._sim_config(spec)
    bm = default_manager(AllocatorSpec("paged", spec.block_size), sim_cfg)
    sched = Scheduler(bm, max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                      stop=StopRule(frozenset(), spec.max_model_len), policy="mixed",
                      prefix_caching=spec.enable_prefix_caching, watermark_blocks=0)

    def step_s(shape) -> float:
        extra = state["extra"]
        state["extra"] = extra[1:]
        return STEP_S + (extra[0] if extra else 0.0)

    return EngineCore(sched, SimulatedExecutor(step_s), clock=SimClock(1024.0))


def _wait(core: EngineCore, state: dict):
    """The loop's idle wait: it picks the arrival up WAKE's pick-up later, and its next steps run slower."""
    def wait(t: float) -> None:
        gap = t - core.clock.now()
        state["extra"] = WAKE(gap)
        core.clock.advance_to(t + WAKE.pickup(gap))
    return wait


def test_the_simulator_charges_the_wake_to_the_steps_after_each_idle_jump() -> None:
    spec = dataclasses.replace(load_config(CONFIG, quick=True).engine, num_blocks=64, max_num_seqs=4,
                               max_num_batched_tokens=64)
    trace, arrivals = _trace()
    state = {"extra": ()}
    core = _waking_core(spec, state)
    log = StepLog()
    real = serve_online(core, arrivals, trace.prompts, trace.output_lens, log.waiting(_wait(core, state)),
                        log.recorder(core))
    sim = serve_simulated_online(spec, trace, arrivals, with_wake(constant_step(STEP_S), WAKE))
    assert len(real) == len(sim)
    for r, s in zip(real, sim):
        assert s.first_scheduled_s == pytest.approx(r.first_scheduled_s, abs=1e-9)
        assert s.token_times_s == pytest.approx(r.token_times_s, abs=1e-9)
    # not trivial: without the wake the times differ, and charged to every step they differ too
    plain = serve_simulated_online(spec, trace, arrivals, constant_step(STEP_S))
    assert any(p.token_times_s[0] != pytest.approx(r.token_times_s[0], abs=1e-9) for p, r in zip(plain, real))
    first_only = WakeCost(WAKE.gaps_s, tuple(row[:1] for row in WAKE.extra_s), pickup_s=WAKE.pickup_s)  # later steps
    short = serve_simulated_online(spec, trace, arrivals, with_wake(constant_step(STEP_S), first_only))
    assert any(p.token_times_s[-1] != pytest.approx(r.token_times_s[-1], abs=1e-9) for p, r in zip(short, real))
    no_pickup = WakeCost(WAKE.gaps_s, WAKE.extra_s)
    late = serve_simulated_online(spec, trace, arrivals, with_wake(constant_step(STEP_S), no_pickup))
    assert any(p.first_scheduled_s != pytest.approx(r.first_scheduled_s, abs=1e-9) for p, r in zip(late, real))
    # the step error predicts the waking steps with the wake too: exact on the real steps
    woken = sum(g is not None for g in log.idle_gaps_s)
    assert 2 < woken < len(log.steps) and log.idle_gaps_s[0] == pytest.approx(arrivals[0])
    e = step_error(log.steps, with_wake(constant_step(STEP_S), WAKE), log.after_idle, log.idle_gaps_s)
    assert e["median_abs_rel_error"] == pytest.approx(0.0, abs=1e-9)
    assert e["predicted_over_measured_total"] == pytest.approx(1.0)
    assert step_error(log.steps, constant_step(STEP_S), log.after_idle, log.idle_gaps_s)[
        "predicted_over_measured_total"] < 1.0  # no wake: the waking steps are under-predicted
