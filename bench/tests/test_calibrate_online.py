"""The online check's pieces: the KS statistic against hand-computed values, and the real-time serving loop
against the simulator on an engine whose steps take a constant simulated time (they must agree exactly)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from pagedbench.bench.sim.run import default_manager
from pagedbench.bench.sim.simulator import AllocatorSpec, constant_step
from pagedbench.bench.studies.calibrate import online as calibrate_online
from pagedbench.bench.studies.calibrate.config import CONFIG, load_config
from pagedbench.bench.studies.calibrate.online import load_cost, serve_online, serve_simulated_online
from pagedbench.bench.studies.calibrate.online_compare import compare_runs, ks_statistic
from pagedbench.bench.workloads.token_traces import Trace
from pagedbench.refengine.engine.core import EngineCore, SimClock, SimulatedExecutor
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([1.0, 2.0, 3.0], [2.5, 4.0], 2 / 3),  # CDFs at 2: 2/3 against 0
    ([3.0, 1.0, 2.0], [4.0, 2.5], 2 / 3),  # unsorted input: the same samples
    ([1.0, 2.0, 2.0, 3.0], [2.0, 2.0, 2.0, 5.0], 0.25),  # ties: at 1 (1/4 vs 0) and at 3 (1 vs 3/4)
    ([1.0, 1.0, 1.0], [1.0, 2.0, 3.0], 2 / 3),  # at 1: 1 against 1/3
    ([0.5, 0.7], [0.6, 0.8], 0.5),  # interleaved: at 0.5, 1/2 vs 0
    ([1.0, 2.0], [3.0, 4.0, 5.0], 1.0),  # disjoint
    ([2.0, 1.0, 3.0], [1.0, 2.0, 3.0], 0.0),  # the same sample
])
def test_ks_statistic_hand_computed(a, b, expected) -> None:
    assert ks_statistic(a, b) == pytest.approx(expected)
    assert ks_statistic(b, a) == pytest.approx(expected)


def test_ks_statistic_refuses_empty_or_non_finite() -> None:
    with pytest.raises(ValueError, match="sizes 0 and 2"):
        ks_statistic([], [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        ks_statistic([1.0, float("nan")], [1.0])


def _spec():
    return dataclasses.replace(load_config(CONFIG, quick=True).engine, num_blocks=64, max_num_seqs=4,
                               max_num_batched_tokens=64)


def _stub_core(spec, step_s: float) -> EngineCore:
    """An engine with the simulator's scheduler settings whose every step lasts ``step_s`` simulated seconds."""
    sim_cfg = calibrate_online._sim_config(spec)
    bm = default_manager(AllocatorSpec("paged", spec.block_size), sim_cfg)
    sched = Scheduler(bm, max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                      stop=StopRule(frozenset(), spec.max_model_len), policy="mixed",
                      prefix_caching=spec.enable_prefix_caching, watermark_blocks=0)
    return EngineCore(sched, SimulatedExecutor(constant_step(step_s)), clock=SimClock(1024.0))


def _trace(n: int = 10) -> tuple[Trace, list[float]]:
    rng = np.random.default_rng(0)
    prompts = tuple(tuple(rng.integers(0, 100, int(k)).tolist()) for k in rng.integers(3, 90, n))
    outputs = tuple(int(k) for k in rng.integers(1, 12, n))
    # a burst (queueing, chunked prefill), then gaps longer than the work (idle waits)
    arrivals = np.cumsum(np.r_[rng.exponential(0.002, n // 2), rng.exponential(0.3, n - n // 2)])
    # multiples of 2^-10 s, and steps of 2^-7 s: every clock reading is exact, so times compare with ==
    return Trace(prompts, outputs), (np.round(arrivals * 1024) / 1024).tolist()


STEP_S = 1 / 128


def test_serve_online_on_a_constant_step_engine_agrees_with_the_simulator_exactly() -> None:
    spec, (trace, arrivals) = _spec(), _trace()
    runs = []
    for _ in range(2):
        core = _stub_core(spec, STEP_S)
        runs.append(serve_online(core, arrivals, trace.prompts, trace.output_lens, core.clock.advance_to))
    sim = serve_simulated_online(spec, trace, arrivals, constant_step(STEP_S))
    assert runs[0] == sim  # arrivals, first scheduling and every token time
    assert max(t.token_times_s[0] - t.arrival_s for t in sim) > 2 * STEP_S  # the burst queued: the case is not trivial
    result = compare_runs(*runs, sim, goal_floor=0.1, goal_spread_factor=1.5)
    for name in ("ttft", "tpot", "e2el"):
        m = result[name]
        assert m["median_abs_rel_error"] == 0 and m["real_spread_median"] == 0 and m["goal_met"] and m["floor_met"]
        assert all(q["rel_error"] == 0 for q in m["quantiles"])
        assert m["ks"] == {"sim_vs_real_a": 0.0, "sim_vs_real_b": 0.0, "real_a_vs_real_b": 0.0}


def test_compare_sees_a_simulator_ten_percent_slow() -> None:
    spec, (trace, arrivals) = _spec(), _trace()
    core = _stub_core(spec, STEP_S)
    real = serve_online(core, arrivals, trace.prompts, trace.output_lens, core.clock.advance_to)
    sim = serve_simulated_online(spec, trace, arrivals, constant_step(1.1 * STEP_S))
    result = compare_runs(real, real, sim, goal_floor=0.05, goal_spread_factor=1.5)
    tpot = result["tpot"]  # one token per step once decoding: TPOT is the step time
    assert tpot["median_signed_rel_error"] == pytest.approx(0.1)
    assert all(q["rel_error"] == pytest.approx(0.1) for q in tpot["quantiles"])
    assert tpot["ks"]["sim_vs_real_a"] == 1.0 and not tpot["goal_met"] and tpot["goal"] == 0.05
    assert not tpot["floor_met"] and result["ttft"]["floor_met"] == (result["ttft"]["median_abs_rel_error"] <= 0.05)
    assert result["e2el"]["median_signed_rel_error"] > 0.05


def test_serve_online_and_compare_refuse_bad_input(tmp_path) -> None:
    spec, (trace, arrivals) = _spec(), _trace(4)
    core = _stub_core(spec, STEP_S)
    with pytest.raises(ValueError, match="non-decreasing"):
        serve_online(core, arrivals[::-1], trace.prompts, trace.output_lens, core.clock.advance_to)
    with pytest.raises(ValueError, match="got 3, 4 and 4"):
        serve_online(core, arrivals[:3], trace.prompts, trace.output_lens, core.clock.advance_to)
    assert not core.has_unfinished()
    real = serve_online(core, arrivals, trace.prompts, trace.output_lens, core.clock.advance_to)
    with pytest.raises(ValueError, match="unfinished"):
        compare_runs(real, real, (dataclasses.replace(real[0], token_times_s=()), *real[1:]),
                     goal_floor=0.1, goal_spread_factor=1.5)
    record = tmp_path / "calibration.json"
    record.write_text(json.dumps({"config": {"engine": {"model": "other"}}}))
    with pytest.raises(ValueError, match="calibrated on engine"):
        load_cost(record, spec)


def test_compare_reads_the_error_against_the_mean_of_two_real_runs_and_their_spread() -> None:
    spec, (trace, arrivals) = _spec(), _trace()
    real = []
    for step_s in (STEP_S, 1.2 * STEP_S):  # two "real" runs 20% apart
        core = _stub_core(spec, step_s)
        real.append(serve_online(core, arrivals, trace.prompts, trace.output_lens, core.clock.advance_to))
    sim = serve_simulated_online(spec, trace, arrivals, constant_step(1.1 * STEP_S))
    tpot = compare_runs(*real, sim, goal_floor=0.1, goal_spread_factor=1.5)["tpot"]
    assert tpot["median_abs_rel_error"] == pytest.approx(0.0, abs=1e-9)  # the mean of the two: 1.1 x step
    assert tpot["real_spread_median"] == pytest.approx(0.2 / 1.1)
    assert tpot["goal"] == pytest.approx(1.5 * 0.2 / 1.1) and tpot["goal_met"]
    assert tpot["quantiles"][0]["real_spread"] == pytest.approx(0.2 / 1.1)
    assert tpot["ks"]["real_a_vs_real_b"] == 1.0


def test_report_states_the_goal_and_every_metric_row() -> None:
    from pagedbench.bench.common.environment import environment
    from pagedbench.bench.studies.calibrate.online_report import render_markdown

    spec, (trace, arrivals) = _spec(), _trace()
    core = _stub_core(spec, STEP_S)
    real = serve_online(core, arrivals, trace.prompts, trace.output_lens, core.clock.advance_to)
    sim = serve_simulated_online(spec, trace, arrivals, constant_step(1.1 * STEP_S))
    metrics = compare_runs(real, real, sim, goal_floor=0.05, goal_spread_factor=1.5)
    record = {"config": {"engine": dataclasses.asdict(spec), "cost_model": {"label": "stub"}, "calibration": "x",
                         "num_requests": 10, "length_scale": 1.0, "mean_prompt_len": 40.0, "mean_output_len": 6.0,
                         "arrival_seed": 0, "goal_floor": 0.05, "goal_spread_factor": 1.5},
              "saturation_rate_per_s": 9.0, "run_wall_s": 1.0, "goal_met": False, "median_abs_rel_error_all": 0.1,
              "machine_load": {"cpu_count": 2, "loadavg_before": [1.0, 1, 1], "loadavg_after": [2.0, 1, 1]},
              "environment": environment(),
              "rates": [{"name": "low", "fraction_of_saturation": 0.15, "rate_per_s": 1.35, "last_arrival_s": 2.0,
                         "metrics": metrics}]}
    text = render_markdown(record)
    assert f"**Goal NOT met** (met for {sum(m['goal_met'] for m in metrics.values())} of 3 metrics x rates;" in text
    floor_met = sum(m["floor_met"] for m in metrics.values())
    assert f"Against the 5% floor alone (the goal without the spread's allowance): met for {floor_met} of 3." in text
    tpot_row = next(line for line in text.splitlines() if line.startswith("| TPOT |"))
    assert "| 10.0% (signed +10.0%) | 0.0% | 5.0% | NO | +10.0% (0.0%) |" in tpot_row
    assert tpot_row.endswith("| 1.00 / 1.00 | 0.00 |")
    assert "| TTFT |" in text and "| E2E |" in text


def test_busy_wall_time_is_the_union_of_the_requests_spans() -> None:
    from pagedbench.bench.common.serving_metrics import RequestTiming
    from pagedbench.bench.studies.calibrate.online import _busy_wall_s

    spans = [(0.0, 1.0), (0.5, 2.0), (0.6, 0.9), (3.0, 4.0)]  # overlapping, nested, apart: 2 + 1
    timings = [RequestTiming(i, a, 1, 1, a, (b,)) for i, (a, b) in enumerate(spans)]
    assert _busy_wall_s(timings, 10.0) == pytest.approx(3.0)
    assert _busy_wall_s(timings, 2.5) == 2.5


def test_step_error_on_every_step_the_loop_reports() -> None:
    from pagedbench.bench.studies.calibrate.online import step_error
    from pagedbench.refengine.engine.core import StepShape

    spec, (trace, arrivals) = _spec(), _trace()
    core, steps = _stub_core(spec, STEP_S), []
    serve_online(core, arrivals, trace.prompts, trace.output_lens, core.clock.advance_to,
                 lambda r: steps.append((StepShape.of(r.output), r.end_s - r.start_s)))
    assert len(steps) > len(trace.prompts) and all(t == STEP_S for _, t in steps)
    e = step_error(steps, constant_step(1.1 * STEP_S))
    assert e["num_steps"] == len(steps) and e["median_rel_error"] == pytest.approx(0.1)
    assert e["predicted_over_measured_total"] == pytest.approx(1.1)
    assert 0 < e["num_steps_with_prefill"] < len(steps)
    assert e["median_rel_error_by_kind"] == {"with_prefill": pytest.approx(0.1), "decode_only": pytest.approx(0.1)}
    # split by whether a step woke an idle engine: each prefill step's error lands in its own half
    idle = [not shape.decode_context_lens for shape, _ in steps]  # flagged: the steps with no decode
    by_idle = step_error(steps, lambda s: (0.5 if s.decode_context_lens else 2.0) * STEP_S, idle)
    kinds = by_idle["median_rel_error_by_kind"]
    assert kinds["with_prefill_after_idle"] == pytest.approx(1.0) and kinds["with_prefill_while_busy"] == -0.5
    assert by_idle["num_steps_after_idle"] == sum(idle)
    with pytest.raises(ValueError, match="one after_idle flag per step"):
        step_error(steps, constant_step(STEP_S), idle[:-1])


def test_step_log_flags_the_steps_that_wake_an_idle_engine() -> None:
    from pagedbench.bench.studies.calibrate.online import StepLog

    spec, (trace, arrivals) = _spec(), _trace()
    log = StepLog()
    for _ in range(2):  # two runs into one log: each run's first step starts an empty engine
        core = _stub_core(spec, STEP_S)
        serve_online(core, arrivals, trace.prompts, trace.output_lens, core.clock.advance_to, log.recorder(core))
    assert len(log.after_idle) == len(log.steps) and log.after_idle[0]
    woke = [shape for (shape, _), idle in zip(log.steps, log.after_idle) if idle]
    # a step that wakes the engine has nothing to decode; the stub's sparse arrivals make it idle now and then
    assert len(woke) > 2 and all(not shape.decode_context_lens and shape.prefill_chunks for shape in woke)
    # nothing was in flight: every chunk of a waking step is the first of its prompt (chunk = its context)
    assert all(q == ctx for shape in woke for q, ctx in shape.prefill_chunks)
    # the burst's chunked prefill runs steps with no decode too, but with work in flight: not flagged
    assert any(not idle and not shape.decode_context_lens for (shape, _), idle in zip(log.steps, log.after_idle))


def test_report_shows_the_in_process_fit_beside_the_published_one() -> None:
    """A second model (the grid refit in the check's own process) gets its own verdict and tables; a record
    without one (--no-refit) gets no such section."""
    from pagedbench.bench.common.environment import environment
    from pagedbench.bench.studies.calibrate.online_report import render_markdown

    spec, (trace, arrivals) = _spec(), _trace()
    core = _stub_core(spec, STEP_S)
    real = serve_online(core, arrivals, trace.prompts, trace.output_lens, core.clock.advance_to)
    slow = compare_runs(real, real, serve_simulated_online(spec, trace, arrivals, constant_step(1.3 * STEP_S)),
                        goal_floor=0.05, goal_spread_factor=1.5)
    exact = compare_runs(real, real, serve_simulated_online(spec, trace, arrivals, constant_step(STEP_S)),
                         goal_floor=0.05, goal_spread_factor=1.5)
    record = {"config": {"engine": dataclasses.asdict(spec), "cost_model": {"label": "stub"}, "calibration": "x",
                         "num_requests": 10, "length_scale": 1.0, "mean_prompt_len": 40.0, "mean_output_len": 6.0,
                         "arrival_seed": 0, "goal_floor": 0.05, "goal_spread_factor": 1.5},
              "saturation_rate_per_s": 9.0, "run_wall_s": 1.0, "goal_met": False, "median_abs_rel_error_all": 0.3,
              "machine_load": {"cpu_count": 2, "loadavg_before": [1.0, 1, 1], "loadavg_after": [2.0, 1, 1]},
              "environment": environment(), "in_process_fit": {"label": "refit here"},
              "goal_met_in_process_fit": True,
              "rates": [{"name": "low", "fraction_of_saturation": 0.15, "rate_per_s": 1.35, "last_arrival_s": 2.0,
                         "metrics": slow, "in_process_fit": {"step_error": None, "metrics": exact}}]}
    text = render_markdown(record)
    section = text.split("## The same check with the grid refit in this process")[1]
    assert "(refit here)" in section and "**Goal met** for 3 of 3 metrics x rates" in section
    assert "| TPOT | 0.0% (signed +0.0%) |" in section  # the refit's table, not the published model's
    assert "| TPOT | 30.0% (signed +30.0%) |" in text.split("## The same check")[0]
    del record["in_process_fit"]
    assert "## The same check" not in render_markdown(record)


def test_step_log_measures_an_idle_wait_to_the_arrival_the_loop_waited_for() -> None:
    """To the arrival, not to the step's start (the loop's pick-up comes after it); a step of an idle engine whose
    arrival came during the previous step had no wait: its gap is to its own start, not to an earlier wait's."""
    from pagedbench.bench.studies.calibrate.online import StepLog

    spec = _spec()
    core = _stub_core(spec, STEP_S)
    log = StepLog()

    def late_wait(t: float) -> None:  # picks the arrival up a 1/1024 s late
        core.clock.advance_to(t + 1 / 1024)

    start = core.clock.now()
    arrivals = [4 * STEP_S, 4.5 * STEP_S]  # the second arrives during the first's only step
    serve_online(core, arrivals, [(1, 2, 3), (4, 5)], [1, 1], log.waiting(late_wait), log.recorder(core))
    assert log.after_idle == [True, True]
    assert log.idle_gaps_s == [4 * STEP_S, 0.0]  # not 4 x STEP_S + 1/1024, and not the first wait's again
    assert log.steps and core.clock.now() == start + 6 * STEP_S + 1 / 1024
