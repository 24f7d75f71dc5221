"""The simulator checked online: the calibrated step-cost model against the real CPU engine under
Poisson arrivals in real time.

``python -m pagedbench.bench calibrate_online`` (after ``calibrate``, whose fitted model it reads from
``results/calibration.json``):

1. A ShareGPT-like trace on the calibration engine (``bench/configs/calibrate.yaml``), and its
   saturation rate: the trace served as one offline batch in the simulator with the fitted model,
   requests / makespan.
2. Poisson arrivals (seeded) at a low rate and at a rate near saturation (fractions of that rate).
3. Per rate, the real engine twice on the wall clock (:func:`serve_online`: a loop that queues each
   request once its arrival time has passed and otherwise steps, or sleeps when idle), and the serving
   simulator once with the fitted model on the same arrivals; the model includes the calibration's
   measured cost of waking an idle engine (:mod:`bench.costmodel.wake_cost`), charged to the first step
   after each idle wait of the simulator's clock, and what a prefill costs the decode steps after it
   (:mod:`bench.costmodel.after_prefill`), charged to the first decode steps after each prefill.
4. TTFT, TPOT and E2E compared per request, at p50/p90/p99 and by the KS statistic
   (:mod:`bench.studies.calibrate.online_compare`), beside the two real runs' spread.
5. The same comparison for a second model: the calibration grid measured again in this process just
   before the real runs and fitted the same way (``--no-refit`` skips it). A shared machine's speed
   moves between sessions by more than the model's error; this model sees the speed the runs see, so the
   two together separate the model's error from the machine's drift. Both are published; neither is tuned.

The published fit is checked only on the machine it was measured on (:func:`fit_for_check`): where this
machine's CPU model or core count differs from the one the calibration record names (or the record names
none), the grid is measured and fitted here first, in this session, and every error is reported against that
fit; the record's ``fit_used`` says which fit was checked and why (the second model is then the same one,
and is not run again).

Writes ``results/calibration_online.json`` and ``.md`` atomically.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from pagedbench.bench import workloads
from pagedbench.bench.common.environment import RESULTS_DIR, SCHEMA_VERSION, environment
from pagedbench.bench.common.records import write_json, write_text
from pagedbench.bench.common.serving_metrics import RequestTiming
from pagedbench.bench.costmodel.after_prefill import AfterPrefillCost
from pagedbench.bench.costmodel.batched_cost import BATCHED_TERMS, BatchedStepCost
from pagedbench.bench.costmodel.calibration import CalibrationMachine, FitChoice, choose_fit, this_machine
from pagedbench.bench.costmodel.wake_cost import WakeCost, with_wake
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.bench.studies.calibrate.config import CONFIG, EngineSpec, load_config, load_engine_model
from pagedbench.bench.studies.calibrate.online_compare import compare_runs
from pagedbench.bench.studies.calibrate.online_report import render_markdown
from pagedbench.bench.studies.calibrate.steps import build_engine, calibration_steps, fit, priced_after, step_batch
from pagedbench.bench.studies.calibrate.validation import serve_simulated
from pagedbench.bench.workloads.arrivals import arrival_times
from pagedbench.bench.workloads.token_traces import Trace, Workload, make_trace
from pagedbench.refengine import SamplingParams
from pagedbench.refengine.engine.core import EngineCore, StepReport, StepShape

#: the trace and the two rates (fractions of the fitted model's saturation rate); small, so the whole
#: check (four real runs) takes well under two minutes
NUM_REQUESTS, LENGTH_SCALE, TRACE_SEED, ARRIVAL_SEED = 32, 0.25, 2, 3
RATE_FRACTIONS = {"low": 0.15, "near_saturation": 0.85}
GOAL_FLOOR, GOAL_SPREAD_FACTOR = 0.10, 1.5


def wall_wait_until(clock) -> Callable[[float], None]:
    """Sleep until ``clock`` reads ``t`` (the real engine's idle wait)."""
    def wait(t: float) -> None:
        delay = t - clock.now()
        if delay > 0:
            time.sleep(delay)
    return wait


def serve_online(core: EngineCore, arrivals_s: Sequence[float], prompts: Sequence[Sequence[int]],
                 output_lens: Sequence[int], wait_until: Callable[[float], None],
                 on_step: Callable[[StepReport], None] | None = None) -> tuple[RequestTiming, ...]:
    """Serve request ``i`` (``prompts[i]``, exactly ``output_lens[i]`` tokens) arriving ``arrivals_s[i]``
    seconds after the start, on ``core``'s clock: queue each request once its time has passed, otherwise
    step, or ``wait_until`` the next arrival when nothing runs. Times are seconds from the start; a
    request's arrival is its scheduled time, so a late pick-up by the loop counts as its queueing.
    ``on_step(report)`` sees every step."""
    if not len(arrivals_s) == len(prompts) == len(output_lens):
        raise ValueError(f"expected one arrival, prompt and output length per request, got "
                         f"{len(arrivals_s)}, {len(prompts)} and {len(output_lens)}")
    if any(b < a for a, b in itertools.pairwise(arrivals_s)) or any(a < 0 for a in arrivals_s):
        raise ValueError("arrival times must be >= 0 and non-decreasing")
    clock = core.clock
    start = clock.now()
    pending = deque(range(len(prompts)))
    index_of: dict[int, int] = {}  # seq_id -> request index
    first: dict[int, float] = {}
    tokens: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    while pending or core.has_unfinished():
        now = clock.now()
        while pending and start + arrivals_s[pending[0]] <= now:
            i = pending.popleft()
            req = core.new_request(list(prompts[i]), SamplingParams(max_tokens=output_lens[i], ignore_eos=True),
                                   arrival_s=start + arrivals_s[i])
            core.add(req)
            index_of[req.children[0].seq_id] = i
        if not core.has_unfinished():
            wait_until(start + arrivals_s[pending[0]])
            continue
        report = core.step()
        if on_step is not None:
            on_step(report)
        for c in report.output.chunks:
            i = index_of.get(c.seq.seq_id)
            if i is not None and i not in first:
                first[i] = report.start_s - start
        for seq_id in report.sampled:
            tokens[index_of[seq_id]].append(report.end_s - start)
    return tuple(RequestTiming(i, float(arrivals_s[i]), len(prompts[i]), output_lens[i], first.get(i),
                               tuple(tokens[i])) for i in range(len(prompts)))


def _sim_config(spec: EngineSpec) -> SimConfig:
    return SimConfig(kv_slots=spec.num_blocks * spec.block_size, max_seq_len=spec.max_model_len, watermark=0.0,
                     warmup_frac=0.0, drain=True, max_num_seqs=spec.max_num_seqs,
                     max_num_batched_tokens=spec.max_num_batched_tokens, policy="mixed",
                     enable_prefix_caching=spec.enable_prefix_caching)


def serve_simulated_online(spec: EngineSpec, trace: Trace, arrivals_s: Sequence[float],
                           step_time_s: Callable) -> tuple[RequestTiming, ...]:
    """The trace in the serving simulator, request ``i`` arriving at ``arrivals_s[i]``."""
    requests = tuple(workloads.Request(i, len(p), o, float(t))
                     for i, (p, o, t) in enumerate(zip(trace.prompts, trace.output_lens, arrivals_s)))
    result = simulate(requests, AllocatorSpec("paged", spec.block_size), _sim_config(spec), step_time_s=step_time_s,
                      account=False, prompt_tokens=lambda r: list(trace.prompts[r.request_id]), fast_forward=False)
    if len(result.requests) != len(requests):
        raise RuntimeError(f"the simulator timed {len(result.requests)} of {len(requests)} requests")
    return tuple(sorted(result.requests, key=lambda t: t.request_id))


def _busy_wall_s(timings: Sequence[RequestTiming], run_wall_s: float) -> float:
    """Wall seconds in which at least one request was in the engine (the union of arrival..last token)."""
    spans = sorted((t.arrival_s, t.token_times_s[-1]) for t in timings)
    busy, end = 0.0, -1.0
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return min(busy, run_wall_s)


class StepLog:
    """The steps of :func:`serve_online` runs: ``steps[i]`` = (shape, seconds), ``after_idle[i]`` = step ``i``
    started an engine with nothing in flight (its run's first step, or one after a step that left no request
    unfinished: the loop then waits for the next arrival), and ``idle_gaps_s[i]`` = how long it had waited
    (from the previous step's end, or the recorder's creation, to the arrival it waited for when the loop's
    wait is :meth:`waiting`'s, else to the step's start; None for a step of a busy engine). To the arrival, not
    to the step: the simulator prices a wait by the time it jumps, and the loop's pick-up comes after it."""

    def __init__(self) -> None:
        self.steps: list[tuple[StepShape, float]] = []
        self.after_idle: list[bool] = []
        self.idle_gaps_s: list[float | None] = []
        self._waited_until: float | None = None

    def waiting(self, wait_until: Callable[[float], None]) -> Callable[[float], None]:
        """``wait_until`` for :func:`serve_online`, noting the arrival it waits for."""
        def wait(t: float) -> None:
            self._waited_until = t
            wait_until(t)
        return wait

    def recorder(self, core: EngineCore) -> Callable[[StepReport], None]:
        """An ``on_step`` for one run on ``core``, made just before the run starts."""
        idle, last_end = True, core.clock.now()  # the first step starts an empty engine

        def record(report: StepReport) -> None:
            nonlocal idle, last_end
            self.steps.append((StepShape.of(report.output), report.end_s - report.start_s))
            self.after_idle.append(idle)
            until = self._waited_until if self._waited_until is not None else report.start_s
            self.idle_gaps_s.append(until - last_end if idle else None)
            self._waited_until = None
            idle, last_end = not core.has_unfinished(), report.end_s

        return record


def step_error(steps: Sequence[tuple[StepShape, float]], step_time_s: Callable[[StepShape], float],
               after_idle: Sequence[bool] | None = None, idle_gaps_s: Sequence[float | None] | None = None) -> dict:
    """The model's relative error on the real runs' own steps (it separates a step model that is off from time
    the loop spends between steps, which the simulator does not model). ``after_idle[i]``: step ``i`` started
    an engine with nothing in flight (the loop had waited for an arrival); given, the steps with a prefill are
    split by it too, since a step that wakes an idle engine runs on cold caches, which no step shape says.
    ``idle_gaps_s[i]``: how long that wait was (None: busy); with a ``step_time_s.wake_s`` (the simulator's
    price of waking, :mod:`bench.costmodel.wake_cost`) the first steps after each wait are predicted with it,
    as the simulator does; with a ``step_time_s.after_prefill_s`` (:mod:`bench.costmodel.after_prefill`) so are
    the first decode steps after each prefill."""
    wake = getattr(step_time_s, "wake_s", None)
    after = getattr(step_time_s, "after_prefill_s", None)
    tracker = after.tracker() if after is not None else None
    if idle_gaps_s is None or wake is None:
        idle_gaps_s = [None] * len(steps)
    elif len(idle_gaps_s) != len(steps):
        raise ValueError(f"expected one idle gap per step ({len(steps)}), got {len(idle_gaps_s)}")
    predicted, extra = [], ()
    for (shape, _), gap in zip(steps, idle_gaps_s):
        if gap is not None:
            extra = wake(gap)
        predicted.append(step_time_s(shape) + (extra[0] if extra else 0.0)
                         + (tracker.extra(shape) if tracker is not None else 0.0))
        extra = extra[1:]
    predicted = np.array(predicted)
    measured = np.array([seconds for _, seconds in steps])
    error = predicted / measured - 1.0
    prefill = np.array([bool(shape.prefill_chunks) for shape, _ in steps])
    kinds = [("with_prefill", prefill), ("decode_only", ~prefill)]
    if after_idle is not None:
        if len(after_idle) != len(steps):
            raise ValueError(f"expected one after_idle flag per step ({len(steps)}), got {len(after_idle)}")
        idle = np.asarray(after_idle, dtype=bool)
        kinds += [("with_prefill_after_idle", prefill & idle), ("with_prefill_while_busy", prefill & ~idle)]
    by_kind = {kind: float(np.median(error[mask])) if mask.any() else None for kind, mask in kinds}
    return {"num_steps": len(steps), "median_rel_error": float(np.median(error)),
            "median_rel_error_by_kind": by_kind, "num_steps_with_prefill": int(prefill.sum()),
            "num_steps_after_idle": None if after_idle is None else int(np.sum(after_idle)),
            "median_abs_rel_error": float(np.median(np.abs(error))),
            "predicted_over_measured_total": float(predicted.sum() / measured.sum())}


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (records do not name a machine's folders)."""
    try:
        return str(Path(path).resolve().relative_to(RESULTS_DIR.resolve().parent))
    except ValueError:
        return str(path)


def load_cost(path: Path, spec: EngineSpec) -> tuple[BatchedStepCost, WakeCost | None, AfterPrefillCost | None]:
    """The wall-clock batched fit of a calibration record, checked to be of ``spec``'s engine, its measured
    cost of waking an idle engine and what a prefill costs the decode steps after it (each None in a record
    from before it was measured)."""
    record = json.loads(Path(path).read_text())
    if record["config"]["engine"] != asdict(spec):
        raise ValueError(f"{path} was calibrated on engine {record['config']['engine']}, expected {asdict(spec)}; "
                         "run `python -m pagedbench.bench calibrate` first")
    cal = record["calibration"]
    missing = [t for t in BATCHED_TERMS if t not in cal["coefficients"]]
    if missing:
        raise ValueError(f"{path}: the fit lacks the batched terms {missing}")
    wake = WakeCost.from_record(cal["wake"]) if cal.get("wake") else None
    after = AfterPrefillCost.from_record(cal["after_prefill"]) if cal.get("after_prefill") else None
    return BatchedStepCost(cal["label"], **{t: cal["coefficients"][t] for t in BATCHED_TERMS}), wake, after


Fit = tuple[BatchedStepCost, WakeCost | None, AfterPrefillCost | None]


def fit_for_check(calibration: Path, spec: EngineSpec, refit_here: Callable[[], Fit],
                  here: CalibrationMachine | None = None) -> tuple[BatchedStepCost, WakeCost | None,
                                                                   AfterPrefillCost | None, FitChoice]:
    """The model the online check is made against, and why: the published fit of ``calibration`` (checked to be
    of ``spec``'s engine) where it was measured on ``here`` (default: this machine), else ``refit_here()``, the
    calibration grid measured and fitted in this session (:func:`pagedbench.bench.costmodel.calibration.choose_fit`)."""
    cost, wake, after = load_cost(calibration, spec)
    choice = choose_fit(CalibrationMachine.from_record(json.loads(Path(calibration).read_text())),
                        here or this_machine())
    if choice.refit:
        cost, wake, after = refit_here()
    return cost, wake, after, choice


def run(config: Path, calibration: Path, refit: bool = True) -> dict:
    """The online check (module docstring); the result record."""
    cfg = load_config(config, quick=False)
    spec = cfg.engine
    load_cost(calibration, spec)  # a record of another engine stops here, before the model loads
    torch.set_num_threads(spec.torch_threads)
    loaded, model_cfg = load_engine_model(spec)

    def refit_here() -> Fit:
        steps, grid_wake, grid_after = calibration_steps(loaded, cfg)
        return fit(steps, after=grid_after), grid_wake, grid_after

    cost, wake, after, choice = fit_for_check(calibration, spec, refit_here)
    refit = refit and not choice.refit  # refitted already: the second model would be this one again
    trace = make_trace(Workload("sharegpt", "sharegpt", LENGTH_SCALE, NUM_REQUESTS),
                       vocab_size=model_cfg.vocab_size, max_model_len=spec.max_model_len, seed=TRACE_SEED)
    offline = serve_simulated(spec, trace, cost, after)
    saturation = NUM_REQUESTS / offline.makespan_s
    load_before, start = os.getloadavg(), time.perf_counter()
    step_time_s = with_wake(lambda shape: cost.step_time_s(step_batch(shape)), wake, priced_after(after, cost))
    warm, _ = build_engine(loaded, spec)  # one untimed offline pass: the first steps of a process are slow
    serve_online(warm.core, [0.0] * 4, trace.prompts[:4], [8] * 4, wall_wait_until(warm.core.clock))
    # The same grid measured again in this process, just before the real runs: a shared machine's speed
    # drifts between sessions by more than the model's error, and this fit sees the speed the runs see.
    here, here_wake, here_after = None, None, None
    if refit:
        here_steps, here_wake, here_after = calibration_steps(loaded, cfg)
        here = fit(here_steps, after=here_after)
    here_time_s = None if here is None else with_wake(lambda shape: here.step_time_s(step_batch(shape)), here_wake,
                                                      priced_after(here_after, here))
    rates = []
    for name, fraction in RATE_FRACTIONS.items():
        rate = fraction * saturation
        arrivals = arrival_times("poisson", NUM_REQUESTS, rate, seed=ARRIVAL_SEED).tolist()
        real, cpu_share, log = [], [], StepLog()
        for _ in range(2):
            llm, _ = build_engine(loaded, spec)
            record_step = log.recorder(llm.core)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            real.append(serve_online(llm.core, arrivals, trace.prompts, trace.output_lens,
                                     log.waiting(wall_wait_until(llm.core.clock)), record_step))
            # the share of a core the run got while it had work (idle sleeps take no CPU): the calibration's
            # steps ran at about 1.0, so a lower share says other processes took the core
            busy_s = _busy_wall_s(real[-1], time.perf_counter() - wall0)
            cpu_share.append((time.process_time() - cpu0) / busy_s if busy_s > 0 else None)
        sim = serve_simulated_online(spec, trace, arrivals, step_time_s)
        row = {"name": name, "fraction_of_saturation": fraction, "rate_per_s": rate,
               "last_arrival_s": arrivals[-1], "real_cpu_share_while_busy": cpu_share,
               "step_error": step_error(log.steps, step_time_s, log.after_idle, log.idle_gaps_s),
               "metrics": compare_runs(*real, sim, goal_floor=GOAL_FLOOR, goal_spread_factor=GOAL_SPREAD_FACTOR),
               "requests": {"real_a": [asdict(t) for t in real[0]], "real_b": [asdict(t) for t in real[1]],
                            "sim": [asdict(t) for t in sim]}}
        if here is not None:
            sim_here = serve_simulated_online(spec, trace, arrivals, here_time_s)
            row["in_process_fit"] = {
                "step_error": step_error(log.steps, here_time_s, log.after_idle, log.idle_gaps_s),
                "metrics": compare_runs(*real, sim_here, goal_floor=GOAL_FLOOR, goal_spread_factor=GOAL_SPREAD_FACTOR)}
            row["requests"]["sim_in_process_fit"] = [asdict(t) for t in sim_here]
        rates.append(row)
    return {
        "schema_version": SCHEMA_VERSION,
        "study": "calibration_online",
        "environment": environment(),
        "fit_used": {"source": "refit in this session" if choice.refit else "published", **choice.to_record()},
        "config": {"path": _shown(config), "calibration": _shown(calibration), "engine": asdict(spec),
                   "cost_model": asdict(cost), "wake": None if wake is None else wake.to_record(),
                   "after_prefill": None if after is None else after.to_record(),
                   "num_requests": NUM_REQUESTS, "length_scale": LENGTH_SCALE,
                   "trace_seed": TRACE_SEED, "arrival_seed": ARRIVAL_SEED, "goal_floor": GOAL_FLOOR,
                   "goal_spread_factor": GOAL_SPREAD_FACTOR,
                   "mean_prompt_len": trace.mean_prompt_len, "mean_output_len": trace.mean_output_len},
        "saturation_rate_per_s": saturation,
        "run_wall_s": time.perf_counter() - start,
        "machine_load": {"cpu_count": os.cpu_count(), "loadavg_before": list(load_before),
                         "loadavg_after": list(os.getloadavg())},
        "rates": rates,
        "in_process_fit": None if here is None else asdict(here),
        "in_process_wake": None if here_wake is None else here_wake.to_record(),
        "in_process_after_prefill": None if here_after is None else here_after.to_record(),
        "goal_met": all(m["goal_met"] for r in rates for m in r["metrics"].values()),
        "goal_met_in_process_fit": None if here is None else all(
            m["goal_met"] for r in rates for m in r["in_process_fit"]["metrics"].values()),
        "median_abs_rel_error_all": float(np.median([m["median_abs_rel_error"] for r in rates
                                                     for m in r["metrics"].values()])),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench calibrate_online", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG, help="the calibration study's YAML config")
    parser.add_argument("--calibration", type=Path, default=RESULTS_DIR / "calibration.json",
                        help="the calibration record whose fitted model is checked")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--full", action="store_true", help="accepted for `python -m pagedbench.bench --full`")
    parser.add_argument("--no-refit", action="store_true",
                        help="skip the second model: the calibration grid measured again in this process")
    args = parser.parse_args(argv)
    record = run(args.config, args.calibration, refit=not args.no_refit)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{args.calibration.stem}_online"  # calibration.json -> calibration_online.json, beside its model's
    write_json(args.out / f"{name}.json", record)
    text = render_markdown(record)
    write_text(args.out / f"{name}.md", text)
    print(text)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
