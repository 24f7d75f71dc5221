"""The calibration study: fit the step-cost model to the real CPU engine, then check it end to end.

``python -m pagedbench.bench calibrate`` (``--quick``: the tiny model and a few shapes, for tests):

1. *Calibration* (:mod:`bench.studies.calibrate.steps`): the engine of ``bench/configs/calibrate.yaml`` (the
   ``small`` random model, fp32, the CPU default ``torch-batched`` attention) serves a grid of step
   shapes (decode batches of 1..32 at a few context lengths and at mixed lengths, prefill chunks of
   several sizes, mixed steps, and decode batches of 1..16 that short prompts join one or two at a time,
   as arrivals in serving make them) after a warm-up; every step is timed and
   :func:`bench.costmodel.calibration.fit_batched_profile` fits the nine terms of that backend (the
   five linear ones, its attention groups, their padding and the prefill group's own work) to them, each
   term's identifiability over the grid recorded beside it; the five-term linear fit
   (:func:`bench.costmodel.fit_profile`) is fitted beside it for comparison. Reported: the
   coefficients and the fit's relative errors (all steps, and by kind), beside the best constant.
2. *Validation* (:mod:`bench.studies.calibrate.validation`): a ShareGPT-like trace the grid never served, on the
   real engine twice and in the serving simulator once with the fitted model; per-request latency
   error against the spread of the two real runs, p50/p90/p99, makespan, and the schedules compared.
3. *Waking an idle engine* (:mod:`bench.costmodel.wake_cost`): the extra time of a step that starts an
   engine which waited idle for an arrival, measured after each of a few waits; the online check
   (``calibrate_online``) charges it to such steps.

Writes ``results/calibration.json`` (one record) and ``results/calibration.md`` atomically.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from pagedbench.bench.common.environment import RESULTS_DIR, SCHEMA_VERSION, environment
from pagedbench.bench.costmodel.after_prefill import AfterPrefillCost
from pagedbench.bench.costmodel.calibration import term_identifiability, terms_of, this_machine
from pagedbench.bench.studies.calibrate.config import CONFIG, CalibrateConfig, load_config, load_engine_model
from pagedbench.bench.studies.calibrate.report import render_markdown, write_results
from pagedbench.bench.studies.calibrate.steps import (
    KINDS,
    TimedStep,
    calibration_steps_by_clock,
    constant_fit,
    decode_errors_since_prefill,
    error_summary,
    fit,
    fit_errors,
    median_rescaled,
    predicted_s,
    samples_of,
    steady_samples,
)
from pagedbench.bench.studies.calibrate.validation import validate

ASSUMPTIONS = (
    "Step time = fixed + c x tokens + h x sampled sequences + a x sum of decode context lengths "
    "+ p x sum over prefill chunks of q x (cached + (q + 1) / 2) + g x attention groups + k x padded decode "
    "keys + r x padded prefill pairs + f x (1 if the step has a prefill group): the compute side of the "
    "roofline, linear in its terms; the memory-side terms are 0 (no separate bandwidth roof on a CPU at these "
    "sizes). The groups are the batched backend's: decodes bucketed by the power of two >= 32 at or above "
    "their length, each bucket padded to its longest sequence (S x L keys), and every prefill chunk in one "
    "group padded to S x max query x max length; f is what a prefill group costs beyond a decode group (its "
    "queries scattered into a padded tensor, its causal mask expanded per query head, its rows gathered back).",
    "Terms the grid cannot separate (identifiability in the coefficient table): the real decode context tokens "
    "and the padded decode keys differ only by the padding inside a bucket (under 2x by the backend's "
    "bucketing; over the grid's steps a median of 2% of the keys and at most about 25%), which on this model is"
    " a few percent of a step at most, below the timing noise: the fit may put that cost on either, and its "
    "choice can change from run to run with little change to any prediction. Both are kept, since a bigger "
    "model or a GPU backend can tell them apart. The real causal prefill pairs and the padded ones are well "
    "separated (the burst's unlike chunks, chunked prompts): a real pair fitted at 0 says the backend pays per "
    "padded pair (its SDPA with an explicit mask computes every masked pair too), which is what its code does.",
    "The linear fit (the first five terms only, as fitted for the per-sequence `torch` backend before) is "
    "fitted to the same steps and validated on the same trace, for comparison.",
    "The target is the whole engine step on the wall clock (schedule + execute + update), so the "
    "scheduler's Python time is folded into the fixed and per-token terms; time between steps is not modelled, "
    "but for the loop's pick-up of an arrival after an idle wait (below).",
    "Omitted: per-block costs (copy-on-write, block-table length), the KV working set against the CPU "
    "caches, allocator and garbage-collector pauses, thread contention and frequency changes, and the first "
    "touch of a fresh engine's KV pool (the grid runs on one engine, each real validation run on a fresh "
    "one). Neither set preempts, so recomputation is not exercised. The grid's steps and the trace's are "
    "timed a few seconds apart: a change of the machine's speed in between (other workers) moves every "
    "step of the trace the same way, which the real-run spread does not show.",
    "The simulator runs the engine's own scheduler and block manager with its settings, so the schedule "
    "is identical step for step (checked); only the step durations differ.",
    "Noise: a shared machine (2 cores, other workers running; load averages recorded), one torch thread; "
    "the spread between two real runs of the same trace measures it, and the goal scales with it. Two "
    "diagnostics separate the model's error from the noise: the same fit and comparison in CPU time "
    "(time.process_time: the time the step held a core), and the wall fit rescaled to a median error of 0 "
    "(least squares on relative error under-predicts a typical step when timings are noisy).",
    "Prompts are random tokens (no prefix is shared); outputs are forced to the trace's lengths (ignore_eos); "
    "every request arrives at t=0.",
    "Waking an idle engine (measured apart from the fit, as pairs of the same lone prompt's first steps served "
    "right after the previous request and after an idle wait): the first steps after a wait run slower than "
    "their shape says (while the loop slept, other processes used the caches the weights were in), the first "
    "most. The simulator adds the median extra time of each of those steps for the wait it skipped "
    "(interpolated between the measured waits, from 0 at none; held past the longest) to the steps after each "
    "idle jump of its clock, whatever their shape, and starts the first step the measured pick-up after the "
    "arrival (the sleep's overshoot, queueing the request, planning the step: the one time between steps it "
    "models). It depends on what else runs on the machine during the "
    "wait. An offline batch (this validation) never waits, so only the online check (calibrate_online) "
    "exercises it.",
    "What a prefill costs the decode steps after it (measured apart from the fit: decode batches of several "
    "sizes that a prompt of several lengths joins every few steps, each of the first decode steps after a join "
    "timed against the same stretch's later ones): on a CPU a decode step right after a prefill runs slower "
    "than the same shape after a long stretch of decodes (the prefill's activations evicted the weights from "
    "the caches), the first most. The batched fits are made on the grid's steps less the median extra of each "
    "decode step's place after its last prefill (interpolated in the prefill's tokens from 0 and in the "
    "batch, held outside the measured sizes), so they price a shape's steady state; the simulator and every "
    "per-step error add it back in step order. The grid's decode steps sit a few steps after a prefill (a "
    "prompt joins every few steps), serving's mostly far from one: fitted without it, the model is pulled to "
    "the costs right after a prefill and over-predicts long decode stretches (the fit without it is reported "
    "beside). The extra depends on the caches, so on the model's size and on what else runs on the machine.",
)


def _sample_row(step: TimedStep, predicted: float) -> dict:
    return {"kind": step.kind, "num_tokens": step.shape.num_tokens,
            "prefill_chunks": [list(c) for c in step.shape.prefill_chunks],
            "decode_context_lens": list(step.shape.decode_context_lens),
            "step_s": step.step_s, "cpu_s": step.cpu_s, "execute_s": step.execute_s, "predicted_s": predicted,
            "rel_error": predicted / step.step_s - 1.0}


def _fit_section(steps: list[TimedStep], cost, clock: str, after: AfterPrefillCost | None) -> dict:
    constant = constant_fit(steps, clock)
    return {
        "label": cost.label,
        "coefficients": {t: getattr(cost, t) for t in terms_of(cost)},
        "fit_errors": fit_errors(cost, steps, clock, after),
        "constant_baseline": {"step_s": constant, "errors": error_summary(
            np.array([constant / s.seconds(clock) - 1.0 for s in steps]))},
    }


def calibration_section(steps: list[TimedStep], costs: dict, wall_s: float,
                        after: AfterPrefillCost | None = None, cpu_after: AfterPrefillCost | None = None) -> dict:
    """The fits (wall clock: the main one; CPU clock, the median-rescaled wall fit and the linear terms'
    wall fit: diagnostics); ``after``: what a prefill costs the decode steps after it, taken off the steps
    before the batched fits and charged with them (the linear terms are the earlier model, without it);
    ``cpu_after``: the same measured in CPU time, for the CPU-clock fit (default: ``after``)."""
    cpu_after = after if cpu_after is None else cpu_after
    return {
        "wall_s": wall_s,
        # the CPU the fit prices: a check on another CPU refits first (calibrate_online)
        "machine": this_machine().to_record(),
        "num_samples": len(steps),
        "num_samples_by_kind": {k: sum(s.kind == k for s in steps) for k in KINDS},
        "max_decode_batch": max((len(s.shape.decode_context_lens) for s in steps), default=0),
        **_fit_section(steps, costs["wall"], "wall", after),
        # per term, the share of its design column no other term explains (0: not identifiable from the grid)
        "identifiability": term_identifiability(samples_of(steps, "wall")),
        "cpu_clock": {**_fit_section(steps, costs["cpu"], "cpu", cpu_after),
                      "after_prefill": cpu_after.to_record() if cpu_after is not None else None},
        "median_rescaled": _fit_section(steps, costs["median_rescaled"], "wall", after),
        "linear_terms": _fit_section(steps, costs["linear"], "wall", None),
        "host_share_median": float(np.median([1.0 - s.execute_s / s.step_s for s in steps])),
        "cpu_share_of_wall": sum(s.cpu_s for s in steps) / sum(s.step_s for s in steps),
        "samples": [_sample_row(s, p) for s, p in zip(steps, predicted_s(costs["wall"], steps, after))],
        "decode_since_prefill": decode_errors_since_prefill(costs["wall"], [steps], "wall", after),
        "after_prefill": after.to_record() if after is not None else None,
        # the steps a noisy aftermath would have taken below half their time, held there (steps.MIN_STEADY_SHARE)
        "after_prefill_floor": {clock: steady_samples(steps, clock, a).to_record()
                                for clock, a in (("wall", after), ("cpu", cpu_after))},
        # the same fit made without it: what pricing it changes
        "without_after_prefill": {
            **_fit_section(steps, costs["without_after_prefill"], "wall", None),
            "decode_since_prefill": decode_errors_since_prefill(costs["without_after_prefill"], [steps], "wall")},
    }


def _validity(record: dict) -> dict:
    reasons = []
    v = record["validation"]
    if not v["schedule"]["same_steps"]:
        reasons.append("the simulator's schedule differs from the real runs' (steps {})".format(
            v["schedule"]["num_steps"]))
    if not v["schedule"]["same_tokens_in_real_runs"]:
        reasons.append("the two real runs generated different tokens")
    if not v["latency"]["goal_met"]:
        reasons.append(f"median per-request latency error {v['latency']['median_abs_rel_error']:.1%} exceeds "
                       f"the goal {v['latency']['goal']:.1%}")
    return {"valid": not reasons, "reasons": reasons}


def run(cfg: CalibrateConfig) -> dict:
    """Calibrate and validate under ``cfg``; the result record."""
    e = cfg.engine
    torch.set_num_threads(e.torch_threads)
    loaded, model_cfg = load_engine_model(e)
    load_before = os.getloadavg()
    start = time.perf_counter()
    steps, wake, by_clock = calibration_steps_by_clock(loaded, cfg)
    after, cpu_after = by_clock["wall"], by_clock["cpu"]  # each fit takes off its own clock's aftermath
    costs = {"wall": fit(steps, "wall", after=after), "cpu": fit(steps, "cpu", after=cpu_after)}
    costs["median_rescaled"] = median_rescaled(costs["wall"], steps, "wall", after)
    costs["linear"] = fit(steps, "wall", batched=False)
    costs["without_after_prefill"] = fit(steps, "wall")
    calibration = calibration_section(steps, costs, time.perf_counter() - start, after, cpu_after)
    calibration["wake"] = wake.to_record()
    start = time.perf_counter()
    validation = validate(loaded, cfg, costs["wall"], costs["cpu"], costs["median_rescaled"], costs["linear"],
                          after, costs["without_after_prefill"], cpu_after=cpu_after)
    validation["wall_s"] = time.perf_counter() - start
    record = {
        "schema_version": SCHEMA_VERSION,
        "study": "calibration",
        "environment": environment(),
        "config": {"path": cfg.path, "quick": cfg.quick, "engine": asdict(cfg.engine), "grid": asdict(cfg.grid),
                   "validation": asdict(cfg.validation), "model_config": model_cfg.to_dict(),
                   "torch_threads_used": torch.get_num_threads()},
        "machine_load": {"cpu_count": os.cpu_count(), "loadavg_before": list(load_before),
                         "loadavg_after": list(os.getloadavg())},
        "calibration": calibration,
        "validation": validation,
        "assumptions": list(ASSUMPTIONS),
    }
    record["validity"] = _validity(record)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny model and a few shapes (tests)")
    parser.add_argument("--full", action="store_true",
                        help="accepted for `python -m pagedbench.bench --full`; the default grid is the full one")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the study's YAML config")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--name", default="calibration",
                        help="the results' file name, without .json/.md (calibrate_online names its own after it)")
    args = parser.parse_args(argv)
    if not args.name or "/" in args.name or args.name.startswith("."):
        parser.error(f"--name must be a plain file name, got {args.name!r}")
    cfg = load_config(args.config, quick=args.quick)
    record = run(cfg)
    record["results_name"] = args.name
    json_path, md_path = write_results(record, args.out, args.name)
    print(render_markdown(record))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
