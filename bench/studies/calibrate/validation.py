"""Checking a fitted step-cost model end to end: one trace, the real engine twice, the simulator once.

The trace (ShareGPT-like lengths from :func:`bench.workloads.synthetic`, scaled to the model, random
prompt tokens) is submitted at t=0 (an offline batch), greedy with ``ignore_eos`` so every request
generates exactly its trace output length. The serving simulator
(:func:`bench.sim.simulator.simulate`) runs the same scheduler and block manager with the engine's
settings (``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``num_blocks``, prefix caching,
mixed policy, no watermark) and the same prompts, so its schedule is the real one step for step
(checked: the same :class:`StepShape` sequence); only the step durations differ.

Compared: each request's latency (finish - arrival), the simulated one against the mean of the two real
runs, beside the spread between the real runs themselves (the machine's noise); the latency
distribution's p50/p90/p99 and the makespan; and the fitted model's error on every real step of the
trace (out of sample: the grid never served this trace).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import numpy as np
from pagedbench.bench import workloads
from pagedbench.bench.costmodel import StepCostModel
from pagedbench.bench.costmodel.after_prefill import AfterPrefillCost
from pagedbench.bench.costmodel.batched_cost import BatchedStepCost
from pagedbench.bench.costmodel.wake_cost import with_wake
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.bench.studies.calibrate.config import CalibrateConfig, EngineSpec, ValidationSpec
from pagedbench.bench.studies.calibrate.steps import (
    TimedStep,
    build_engine,
    decode_errors_since_prefill,
    error_summary,
    predicted_s,
    priced_after,
    run_engine,
    step_batch,
)
from pagedbench.bench.workloads.token_traces import Trace, Workload, make_trace
from pagedbench.refengine import SamplingParams
from pagedbench.refengine.engine.core import StepShape

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True, slots=True)
class Served:
    """One serving of the trace (real or simulated)."""

    latencies_s: tuple[float, ...]  # finish - arrival of each request, trace order
    makespan_s: float  # first arrival to last finish
    shapes: tuple[StepShape, ...]  # the schedule, step by step
    steps: tuple[TimedStep, ...] = ()  # real runs: each step timed
    output_token_ids: tuple[tuple[int, ...], ...] = ()  # real runs: what each request generated
    finish_steps: tuple[int, ...] = ()  # real runs: the index of the step each request finished in

    def on_cpu_clock(self) -> Served:
        """A real run timed in CPU time: a request's latency is the CPU time of every step up to the one it
        finished in (every request arrived before the first step)."""
        elapsed = np.cumsum([s.cpu_s for s in self.steps])
        return dataclasses.replace(self, latencies_s=tuple(float(elapsed[i]) for i in self.finish_steps),
                                   makespan_s=float(elapsed[-1]))


def validation_trace(cfg: CalibrateConfig, vocab_size: int) -> Trace:
    v = cfg.validation
    return make_trace(Workload(v.dataset, v.dataset, v.length_scale, v.num_requests), vocab_size=vocab_size,
                      max_model_len=cfg.engine.max_model_len, seed=v.seed)


def serve_real(loaded, spec: EngineSpec, trace: Trace) -> Served:
    """The trace on a fresh real engine, every request queued before the first step."""
    llm, timer = build_engine(loaded, spec)
    core = llm.core
    requests = [core.new_request(list(p), SamplingParams(max_tokens=o, ignore_eos=True))
                for p, o in zip(trace.prompts, trace.output_lens)]
    for r in requests:
        core.add(r)
    steps = run_engine(llm, timer)
    start = min(r.arrival_s for r in requests)
    step_of_end = {s.end_s: i for i, s in enumerate(steps)}
    return Served(tuple(r.finish_s - r.arrival_s for r in requests), max(r.finish_s for r in requests) - start,
                  tuple(s.shape for s in steps), tuple(steps),
                  tuple(tuple(r.children[0].output_token_ids) for r in requests),
                  tuple(step_of_end[r.finish_s] for r in requests))


def serve_simulated(spec: EngineSpec, trace: Trace, cost: StepCostModel | BatchedStepCost,
                    after: AfterPrefillCost | None = None) -> Served:
    """The trace in the serving simulator, each step lasting what ``cost`` predicts for its shape (plus, with
    ``after``, what a prefill costs the decode steps after it)."""
    shapes: list[StepShape] = []

    def step_time_s(shape: StepShape) -> float:
        shapes.append(shape)
        return cost.step_time_s(step_batch(shape))

    requests = tuple(workloads.Request(i, len(p), o, 0.0)
                     for i, (p, o) in enumerate(zip(trace.prompts, trace.output_lens)))
    sim_cfg = SimConfig(kv_slots=spec.num_blocks * spec.block_size, max_seq_len=spec.max_model_len,
                        watermark=0.0, warmup_frac=0.0, drain=True, max_num_seqs=spec.max_num_seqs,
                        max_num_batched_tokens=spec.max_num_batched_tokens, policy="mixed",
                        enable_prefix_caching=spec.enable_prefix_caching)
    result = simulate(requests, AllocatorSpec("paged", spec.block_size), sim_cfg,
                      step_time_s=with_wake(step_time_s, None, priced_after(after, cost)), account=False,
                      prompt_tokens=lambda r: list(trace.prompts[r.request_id]))
    if result.num_finished != len(requests):
        raise RuntimeError(f"the simulator finished {result.num_finished} of {len(requests)} requests")
    return Served(result.latencies_s, result.simulated_s, tuple(shapes))


def _rel(x: float, ref: float) -> float:
    return x / ref - 1.0


def latency_comparison(a: Served, b: Served, sim: Served, spec: ValidationSpec) -> dict:
    """Per-request latency error of ``sim`` against the mean of the real runs ``a`` and ``b``, beside their
    spread; the goal; the p50/p90/p99 and the makespan."""
    la, lb, ls = (np.array(s.latencies_s) for s in (a, b, sim))
    real = 0.5 * (la + lb)
    error, spread = ls / real - 1.0, np.abs(la - lb) / real
    median_error, median_spread = float(np.median(np.abs(error))), float(np.median(spread))
    goal = max(spec.goal_floor, spec.goal_spread_factor * median_spread)
    quantiles = []
    for q in QUANTILES:
        qa, qb, qs = (float(np.quantile(x, q)) for x in (la, lb, ls))
        mean = 0.5 * (qa + qb)
        quantiles.append({"quantile": q, "real_a_s": qa, "real_b_s": qb, "sim_s": qs,
                          "rel_error": _rel(qs, mean), "real_spread": abs(qa - qb) / mean})
    real_makespan = 0.5 * (a.makespan_s + b.makespan_s)
    return {
        "latency": {"median_abs_rel_error": median_error, "median_signed_rel_error": float(np.median(error)),
                    "p90_abs_rel_error": float(np.quantile(np.abs(error), 0.9)),
                    "real_spread_median": median_spread, "real_spread_p90": float(np.quantile(spread, 0.9)),
                    "goal": goal, "goal_met": median_error <= goal},
        "quantiles": quantiles,
        "makespan": {"real_a_s": a.makespan_s, "real_b_s": b.makespan_s, "sim_s": sim.makespan_s,
                     "rel_error": _rel(sim.makespan_s, real_makespan),
                     "real_spread": abs(a.makespan_s - b.makespan_s) / real_makespan},
    }


def step_errors(cost: StepCostModel | BatchedStepCost, runs: tuple[Served, ...], clock: str,
                after: AfterPrefillCost | None = None) -> dict:
    """The model's relative error on every real step of ``runs`` (out of sample for the grid's fit)."""
    return error_summary(np.concatenate([
        predicted_s(cost, r.steps, after) / np.array([s.seconds(clock) for s in r.steps]) - 1.0 for r in runs]))


def compare(trace: Trace, a: Served, b: Served, sim: Served, cost: StepCostModel | BatchedStepCost,
            spec: ValidationSpec, after: AfterPrefillCost | None = None) -> dict:
    """The wall-clock comparison: the schedules, :func:`latency_comparison`, the step errors, each request."""
    section = latency_comparison(a, b, sim, spec)
    section["makespan"]["share_inside_steps"] = [sum(s.step_s for s in r.steps) / r.makespan_s for r in (a, b)]
    # the share of a core the runs got: against the calibration's, it says how the load moved in between
    section["makespan"]["cpu_share_of_wall"] = [sum(s.cpu_s for s in r.steps) / sum(s.step_s for s in r.steps)
                                                for r in (a, b)]
    rows = zip(trace.prompts, trace.output_lens, a.latencies_s, b.latencies_s, sim.latencies_s)
    return {
        "schedule": {"num_steps": {"real_a": len(a.shapes), "real_b": len(b.shapes), "sim": len(sim.shapes)},
                     "same_steps": a.shapes == b.shapes == sim.shapes,
                     "same_tokens_in_real_runs": a.output_token_ids == b.output_token_ids},
        **section,
        "step_error": step_errors(cost, (a, b), "wall", after),
        "decode_since_prefill": decode_errors_since_prefill(cost, (a.steps, b.steps), "wall", after),
        "requests": [{"request_id": i, "prompt_len": len(p), "output_len": o, "real_a_s": x, "real_b_s": y,
                      "sim_s": s, "rel_error": s / (0.5 * (x + y)) - 1.0, "real_spread": abs(x - y) / (0.5 * (x + y))}
                     for i, (p, o, x, y, s) in enumerate(rows)],
    }


def validate(loaded, cfg: CalibrateConfig, cost, cpu_cost, rescaled_cost, linear_cost=None,
             after: AfterPrefillCost | None = None, plain_cost=None, *,
             cpu_after: AfterPrefillCost | None = None) -> dict:
    """Serve the validation trace twice for real and in the simulator; the validation record section.

    The main comparison is on the wall clock with ``cost``. Two diagnostics beside it: ``cpu_clock``,
    the real runs' latencies in CPU time against the simulator on ``cpu_cost`` (fitted to the grid's CPU
    times: the model's error with most of the machine's contention taken out), and ``median_rescaled``,
    the wall clock against ``rescaled_cost`` (``cost`` at a level without the fit's noise bias); and,
    given ``linear_cost`` (the linear terms only), ``linear_terms``: the wall clock against it. ``after`` (what
    a prefill costs the decode steps after it, which the batched fits were made without) is charged beside
    ``cost``, ``cpu_cost`` and ``rescaled_cost``; the linear terms are the earlier model, without it. Given
    ``plain_cost`` (the batched fit made without ``after``), ``without_after_prefill``: the wall clock against it
    alone, what pricing a prefill's aftermath changes.
    """
    trace = validation_trace(cfg, loaded.config.vocab_size)
    a = serve_real(loaded, cfg.engine, trace)
    b = serve_real(loaded, cfg.engine, trace)
    section = compare(trace, a, b, serve_simulated(cfg.engine, trace, cost, after), cost, cfg.validation, after)
    a_cpu, b_cpu = a.on_cpu_clock(), b.on_cpu_clock()
    cpu_after = after if cpu_after is None else cpu_after  # the CPU fit's aftermath is measured in CPU time
    section["cpu_clock"] = {
        **latency_comparison(a_cpu, b_cpu, serve_simulated(cfg.engine, trace, cpu_cost, cpu_after), cfg.validation),
        "step_error": step_errors(cpu_cost, (a, b), "cpu", cpu_after)}
    section["median_rescaled"] = {
        "label": rescaled_cost.label,
        **latency_comparison(a, b, serve_simulated(cfg.engine, trace, rescaled_cost, after), cfg.validation),
        "step_error": step_errors(rescaled_cost, (a, b), "wall", after)}
    if linear_cost is not None:
        section["linear_terms"] = {
            "label": linear_cost.label,
            **latency_comparison(a, b, serve_simulated(cfg.engine, trace, linear_cost), cfg.validation),
            "step_error": step_errors(linear_cost, (a, b), "wall")}
    if plain_cost is not None:
        section["without_after_prefill"] = {
            "label": plain_cost.label,
            **latency_comparison(a, b, serve_simulated(cfg.engine, trace, plain_cost), cfg.validation),
            "step_error": step_errors(plain_cost, (a, b), "wall"),
            "decode_since_prefill": decode_errors_since_prefill(plain_cost, (a.steps, b.steps), "wall")}
    section["trace"] = {**asdict(cfg.validation), "num_requests": len(trace.prompts),
                        "mean_prompt_len": trace.mean_prompt_len, "mean_output_len": trace.mean_output_len,
                        "max_total_len": max(len(p) + o for p, o in zip(trace.prompts, trace.output_lens))}
    return section
