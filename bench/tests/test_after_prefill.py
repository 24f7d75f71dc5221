"""What a prefill costs the decode steps after it: the interpolation, the one tracker of "decode steps since the
last prefill", the fit made on the steps less it, and the simulator charging it to exactly those steps (against
an engine whose decode steps after a prefill last that much longer)."""

from __future__ import annotations

import numpy as np
import pytest
from pagedbench.bench.costmodel.after_prefill import AfterPrefillCost
from pagedbench.bench.costmodel.batched_cost import BATCHED_TERMS, BatchedStepCost
from pagedbench.bench.costmodel.wake_cost import with_wake
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, constant_step, simulate
from pagedbench.bench.studies.calibrate.online import StepLog, serve_online, serve_simulated_online, step_error
from pagedbench.bench.studies.calibrate.steps import (
    MIN_STEADY_SHARE,
    PricedAfterPrefill,
    TimedStep,
    fit,
    predicted_s,
    samples_of,
    steady_samples,
    step_batch,
)
from pagedbench.bench.tests.test_calibrate_online import STEP_S, _spec, _stub_core, _trace
from pagedbench.bench.workloads import Request
from pagedbench.refengine.engine.core import StepShape

# two batch sizes x two prefill sizes x three decode steps (1/1024 s = ~1 ms)
AFTER = AfterPrefillCost((1, 4), (16, 64), (((4e-4, 2e-4, 1e-4), (8e-4, 4e-4, 2e-4)),
                                             ((2e-4, 1e-4, 0.0), (6e-4, 3e-4, 1e-4))))


def test_interpolates_in_prefill_tokens_from_zero_and_in_the_batch_held_outside() -> None:
    assert AFTER(0, 1) == AFTER(16, 0) == (0.0, 0.0, 0.0)
    assert AFTER(16, 1) == pytest.approx((4e-4, 2e-4, 1e-4))
    assert AFTER(8, 1) == pytest.approx((2e-4, 1e-4, 5e-5))  # half way from nothing at 0 tokens
    assert AFTER(40, 1) == pytest.approx((6e-4, 3e-4, 1.5e-4))  # half way between 16 and 64
    assert AFTER(640, 1) == AFTER(64, 1) == pytest.approx((8e-4, 4e-4, 2e-4))  # held past the largest
    assert AFTER(64, 4) == AFTER(64, 30) == pytest.approx((6e-4, 3e-4, 1e-4))  # held past the widest batch
    assert AFTER(16, 2) == pytest.approx((4e-4 - 2e-4 / 3, 2e-4 - 1e-4 / 3, 1e-4 - 1e-4 / 3))  # 1/3 of 1 -> 4


def test_measured_takes_the_median_difference_per_cell_and_step_and_round_trips() -> None:
    pairs = [[[[(1.0, 1.5), (1.0, 1.1), (2.0, 2.3)], [(1.0, 1.0)]], [[(1.0, 2.0)], [(1.0, 1.05)]]]]
    a = AfterPrefillCost.measured([4], [16, 64], pairs)
    assert a.extra_s == ((pytest.approx((0.3, 0.0)), pytest.approx((1.0, 0.05))),) and a.num_steps == 2
    assert AfterPrefillCost.from_record(a.to_record()) == a


@pytest.mark.parametrize(("batches", "tokens", "extra", "match"), [
    ((), (16,), (), "batches must be"), ((2, 1), (16,), (((0.0,),), ((0.0,),)), "batches must be"),
    ((1,), (0,), (((0.0,),),), "prefill_tokens must be"), ((1,), (64, 16), (((0.0,), (0.0,)),), "prefill_tokens"),
    ((1, 2), (16,), (((0.0,),),), "each of 2 batches x 1"), ((1,), (16, 64), (((0.0,),),), "each of 1 batches x 2"),
    ((1,), (16, 64), (((0.0,), (0.0, 0.0)),), "each of 1 batches x 2"), ((1,), (16,), (((),),), "same number"),
])
def test_refuses_bad_sizes(batches, tokens, extra, match) -> None:
    with pytest.raises(ValueError, match=match):
        AfterPrefillCost(batches, tokens, extra)


def _decode(batch: int) -> StepShape:
    return StepShape((), tuple(range(10, 10 + batch)))


def test_the_tracker_counts_decode_steps_since_the_last_prefill_and_its_tokens() -> None:
    shapes = [_decode(1),  # before any prefill: nothing to charge
              StepShape(((16, 16),), ()), _decode(1), _decode(1), _decode(1), _decode(1),  # the 4th: past 3
              StepShape(((40, 40), (24, 30)), (9,)), _decode(4), StepShape(((64, 64),), (9, 9)), _decode(2),
              _decode(2)]
    expected = [0.0, 0.0, *AFTER(16, 1), 0.0, 0.0, AFTER(64, 4)[0], 0.0, *AFTER(64, 2)[:2]]
    assert AFTER.extras_in_order(shapes) == pytest.approx(expected)
    assert expected[2] and expected[7] and expected[9]  # not trivially zero


def _steps(shapes, seconds) -> list[TimedStep]:
    return [TimedStep(s, t, t, t, 0.0) for s, t in zip(shapes, seconds)]


def test_the_fit_is_made_on_the_steps_less_the_extras_and_predictions_add_them_back() -> None:
    truth = BatchedStepCost("truth", **dict(zip(BATCHED_TERMS, (2e-3, 5e-5, 3e-5, 4e-7, 2e-8, 2e-4, 3e-7, 5e-8,
                                                                  6e-4))))
    rng = np.random.default_rng(0)
    shapes = []
    for _ in range(40):  # prefill steps of several shapes, each followed by decode steps of several batches
        q = int(rng.integers(4, 200))
        shapes.append(StepShape(((q, q + int(rng.integers(0, 50))),), tuple(rng.integers(5, 300, rng.integers(0, 5)))))
        shapes += [StepShape((), tuple(rng.integers(5, 400, int(rng.integers(1, 8))))) for _ in range(5)]
    base = _steps(shapes, [0.0] * len(shapes))
    measured = predicted_s(truth, base) + np.array(AFTER.extras_in_order(shapes))
    steps = _steps(shapes, measured)
    fitted = fit(steps, "wall", after=AFTER)
    for name in BATCHED_TERMS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12), name
    assert predicted_s(fitted, steps, AFTER) == pytest.approx(measured)
    assert [s.seconds for s in samples_of(steps, "wall", AFTER)] == pytest.approx(predicted_s(truth, base))
    plain = fit(steps, "wall")  # without it the steps after a prefill are mispriced
    assert np.max(np.abs(predicted_s(plain, steps) / measured - 1)) > 0.01


def test_noisy_steps_less_a_larger_aftermath_stay_positive_and_the_floored_ones_are_counted() -> None:
    # decode steps after a 64-token prefill at batch 1 (extras 0.8, 0.4, 0.2 ms), timed on a loaded machine:
    # some ran faster than the aftermath the after-prefill runs measured, so the plain difference goes negative
    rng = np.random.default_rng(1)
    shapes, seconds = [], []
    for _ in range(30):
        shapes += [StepShape(((64, 64),), ()), _decode(1), _decode(1), _decode(1)]
        seconds += [2e-3, *np.clip(rng.normal(8e-4, 6e-4, 3), 1e-5, None)]
    steps = _steps(shapes, seconds)
    extras = np.array(AFTER.extras_in_order(shapes))
    measured = np.array(seconds)
    assert (measured - extras < 0).sum() > 5  # the bug's input: the plain difference has negative samples
    expected_clipped = int((measured - extras < MIN_STEADY_SHARE * measured).sum())
    got = steady_samples(steps, "wall", AFTER)
    values = np.array([s.seconds for s in got.samples])
    assert (values > 0).all()
    assert got.num_clipped == expected_clipped > 0
    assert got.to_record() == {"num_samples": len(steps), "num_clipped": expected_clipped,
                               "min_steady_share": MIN_STEADY_SHARE}
    floor = MIN_STEADY_SHARE * measured
    held = measured - extras < floor
    assert values[held] == pytest.approx(floor[held])  # held at the floor, not dropped
    assert values[~held] == pytest.approx((measured - extras)[~held])  # the rest exactly less their extra
    assert [s.seconds for s in samples_of(steps, "wall", AFTER)] == pytest.approx(values)
    fit(steps, "wall", after=AFTER)  # fits: no sample refused
    quiet = steady_samples(steps, "wall")  # no aftermath taken off: nothing to floor
    assert quiet.num_clipped == 0 and [s.seconds for s in quiet.samples] == pytest.approx(seconds)


@pytest.mark.parametrize(("kwargs", "match"), [({"min_steady_share": 0.0}, "min_steady_share must be in"),
                                               ({"min_steady_share": 1.5}, "min_steady_share must be in"),
                                               ({"clock": "gpu"}, "clock must be one of")])
def test_steady_samples_refuse_bad_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        steady_samples(_steps([_decode(1)], [1e-3]), **kwargs)
    with pytest.raises(ValueError, match="needs wall seconds > 0"):
        steady_samples(_steps([_decode(1)], [0.0]))


# an aftermath measured on a loaded machine: the steady steps ran slow, so the median extra is negative, and
# larger than a decode step's whole cost (the truth's steps here are about 2-3 ms)
NEGATIVE = AfterPrefillCost((1, 4), (16, 64), (((-4e-3, -1e-3, 1e-4), (-8e-3, -2e-3, 2e-4)),
                                                ((-4e-3, -1e-3, 0.0), (-8e-3, -2e-3, 1e-4))))
TRUTH = BatchedStepCost("truth", **dict(zip(BATCHED_TERMS, (2e-3, 5e-5, 3e-5, 4e-7, 2e-8, 2e-4, 3e-7, 5e-8, 6e-4))))


def test_a_negative_aftermath_larger_than_a_step_is_priced_at_the_floor() -> None:
    shapes = [StepShape(((64, 64),), ()), _decode(1), _decode(1), _decode(1), _decode(4)]
    steps = _steps(shapes, [1e-3] * len(shapes))
    base = predicted_s(TRUTH, steps)
    raw = base + np.array(NEGATIVE.extras_in_order(shapes))
    assert (raw < 0).any()  # the bug's input: charged as measured, some steps would last less than nothing
    priced = predicted_s(TRUTH, steps, NEGATIVE)
    assert priced == pytest.approx(np.maximum(raw, MIN_STEADY_SHARE * base))
    assert (priced > 0).all()
    assert predicted_s(TRUTH, steps, AFTER) == pytest.approx(base + np.array(AFTER.extras_in_order(shapes)))
    # and one several times a step is held at twice the step (1 / MIN_STEADY_SHARE)
    huge = AfterPrefillCost((1,), (64,), (((2e-2, 1e-4, 0.0),),))
    got = predicted_s(TRUTH, steps, huge)
    assert got[1] == pytest.approx(base[1] / MIN_STEADY_SHARE)
    assert got[2] == pytest.approx(base[2] + huge(64, 1)[1])


def test_the_simulator_runs_a_negative_aftermath_priced_but_not_raw() -> None:
    spec, (trace, arrivals) = _spec(), _trace()
    step = lambda shape: TRUTH.step_time_s(step_batch(shape))  # noqa: E731
    with pytest.raises(ValueError, match="clock cannot go back"):
        serve_simulated_online(spec, trace, arrivals, with_wake(step, None, NEGATIVE))
    timed = serve_simulated_online(spec, trace, arrivals, with_wake(step, None, PricedAfterPrefill(NEGATIVE, TRUTH)))
    assert all(t.token_times_s for t in timed)
    with pytest.raises(ValueError, match="min_steady_share must be in"):
        PricedAfterPrefill(NEGATIVE, TRUTH, 0.0)


def _slow_after_prefill_core(spec):
    """A stub engine: every step lasts STEP_S, and a decode step after a prefill that much more (the tracker's
    count, kept apart from the simulator's own)."""
    core = _stub_core(spec, STEP_S)
    tracker = AFTER.tracker()
    core.executor.step_time_s = lambda shape: STEP_S + tracker.extra(shape)
    return core


def test_the_simulator_charges_the_decode_steps_after_each_prefill() -> None:
    spec = _spec()
    trace, arrivals = _trace()
    core = _slow_after_prefill_core(spec)
    log = StepLog()
    real = serve_online(core, arrivals, trace.prompts, trace.output_lens, lambda t: core.clock.advance_to(t),
                        log.recorder(core))
    sim = serve_simulated_online(spec, trace, arrivals, with_wake(constant_step(STEP_S), None, AFTER))
    for r, s in zip(real, sim, strict=True):
        assert s.first_scheduled_s == pytest.approx(r.first_scheduled_s, abs=1e-9)
        assert s.token_times_s == pytest.approx(r.token_times_s, abs=1e-9)
    plain = serve_simulated_online(spec, trace, arrivals, constant_step(STEP_S))  # not trivial: it differs
    assert any(p.token_times_s[-1] != pytest.approx(r.token_times_s[-1], abs=1e-9) for p, r in zip(plain, real))
    shorter = AfterPrefillCost(AFTER.batches, AFTER.prefill_tokens,
                               tuple(tuple(cell[:1] for cell in row) for row in AFTER.extra_s))
    short = serve_simulated_online(spec, trace, arrivals, with_wake(constant_step(STEP_S), None, shorter))
    assert any(p.token_times_s[-1] != pytest.approx(r.token_times_s[-1], abs=1e-9) for p, r in zip(short, real))
    # the per-step error of the online check prices the real steps the same way: exact
    e = step_error(log.steps, with_wake(constant_step(STEP_S), None, AFTER), log.after_idle, log.idle_gaps_s)
    assert e["median_abs_rel_error"] == pytest.approx(0.0, abs=1e-9)
    assert e["predicted_over_measured_total"] == pytest.approx(1.0)


def test_a_priced_aftermath_turns_the_fast_forward_off_so_results_stay_the_same() -> None:
    rng = np.random.default_rng(1)
    trace = tuple(Request(i, int(rng.integers(4, 60)), int(rng.integers(20, 60)), 0.02 * i) for i in range(24))
    cfg = SimConfig(kv_slots=4096, max_seq_len=256, watermark=0.0, warmup_frac=0.0, drain=True, max_num_seqs=8,
                    max_num_batched_tokens=128, policy="mixed")
    step = with_wake(constant_step(STEP_S), None, AFTER)
    slow = simulate(trace, AllocatorSpec("paged", 16), cfg, step_time_s=step, account=False, fast_forward=False)
    fast = simulate(trace, AllocatorSpec("paged", 16), cfg, step_time_s=step, account=False, fast_forward=True)
    assert fast.latencies_s == slow.latencies_s
    plain = simulate(trace, AllocatorSpec("paged", 16), cfg, step_time_s=constant_step(STEP_S), account=False)
    assert plain.latencies_s != slow.latencies_s
