"""Timing the real engine's steps over a grid of batch shapes, and fitting the step-cost model to them.

The engine runs unchanged: :class:`TimingExecutor` wraps its executor (deciding nothing) and
:func:`run_engine` drives ``EngineCore.step`` itself, keeping each step's :class:`StepShape` and three
durations: the whole step on the wall clock (schedule + execute + update: what one step of the
serving simulator stands for, so the fit's target), the same step in this process's CPU time (what
the step cost when it ran: on a shared machine the wall clock adds the time other processes held the
cores, the CPU clock mostly does not), and the executor alone (wall clock).

The grid (``GridSpec``, bench/configs/calibrate.yaml), served by one engine after an untimed warm-up:

- a *decode run* per context length ``L``: ``decode_batches[0]`` prompts of ``L`` tokens are prefilled
  in chunked steps of up to ``max_num_batched_tokens`` (prefill steps; mixed ones as the first
  sequences start decoding), then decode while requests finish in turn (request ``i`` is given
  ``max_tokens`` so that the batch steps down through ``decode_batches``, about ``steps_per_batch``
  steps at each size), and one more whose prompts cycle through ``spread_contexts`` (decodes of
  several lengths in one step: the batched backend's attention groups); every ``steps_per_batch``
  decode-only steps a fresh prompt from ``mixed_prefill_lens`` joins for one step (a mixed step);
- a *join run* per size in ``join_batches``: that many decodes (prompts from ``spread_contexts``) that
  short prompts of ``join_prefill_lens`` join every other step, one and then two at a time (mixed steps
  of a few short chunks beside a decode batch: what requests arriving one by one make of a step);
- *lone prompts* of each of ``prefill_lens`` (``prefill_repeats`` times), ``max_tokens=1``: prefill-only
  steps, chunked past the token budget; and a *burst* of ``decode_batches[0]`` prompts cycling through
  ``burst_lens``, ``max_tokens=1`` (prefill steps of many chunks of several lengths: an offline batch's
  first steps), ``prefill_repeats`` times;
- *wake pairs* (:meth:`StepGrid.wake_pairs`, timed apart from the fit's steps): a lone prompt's first
  ``wake_steps`` steps served right after the previous request and after an idle wait of each of
  ``wake_gaps_ms``: the cost of the steps that start an idle engine (:mod:`bench.costmodel.wake_cost`);
- *after-prefill runs* (:meth:`StepGrid.after_prefill`, timed apart from the fit's steps): decode batches
  that a prompt joins every ``after_prefill_stretch`` decode steps: what a prefill costs the decode steps
  after it (:mod:`bench.costmodel.after_prefill`). The fit is made on the grid's steps less that cost
  (:func:`samples_of`), so that it prices a shape's steady state, and every prediction of steps in their
  order adds it back (:func:`predicted_s`), as the simulator does.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from pagedbench.bench.costmodel import StepCostModel, StepSample, fit_profile
from pagedbench.bench.costmodel.after_prefill import AfterPrefillCost
from pagedbench.bench.costmodel.batched_cost import BatchedStepCost
from pagedbench.bench.costmodel.calibration import fit_batched_profile, terms_of
from pagedbench.bench.costmodel.wake_cost import WakeCost
from pagedbench.bench.studies.calibrate.aftermath import (
    MIN_STEADY_SHARE,
    PricedAfterPrefill,
    SteadySamples,
    priced_after,
    steady_samples,
)
from pagedbench.bench.studies.calibrate.config import (
    CalibrateConfig,
    EngineSpec,
    after_prefill_tokens,
    decode_run_tokens,
    join_pairs,
    join_run_tokens,
)
from pagedbench.bench.studies.calibrate.shapes import CLOCKS, step_batch
from pagedbench.refengine import LLM, SamplingParams
from pagedbench.refengine.engine.core import StepShape

KINDS = ("decode", "prefill", "mixed")
#: names that live in .shapes and .aftermath, importable from here as before
__all__ = ["CLOCKS", "KINDS", "MIN_STEADY_SHARE", "PricedAfterPrefill", "SteadySamples", "StepGrid", "TimedStep",
           "TimingExecutor", "build_engine", "calibration_steps", "calibration_steps_by_clock", "constant_fit",
           "decode_errors_since_prefill", "error_summary", "fit", "fit_errors", "median_rescaled", "predicted_s",
           "priced_after", "run_engine", "samples_of", "steady_samples", "step_batch"]


@dataclass(frozen=True, slots=True)
class TimedStep:
    """One real engine step: what ran and how long it took."""

    shape: StepShape
    step_s: float  # the whole EngineCore.step: schedule + execute + update (wall clock)
    cpu_s: float  # the same step in this process's CPU time (time.process_time)
    execute_s: float  # the executor's execute() alone (model forward, sampling; wall clock)
    end_s: float  # the engine clock when the step ended (a request finishing in it has this finish_s)

    def seconds(self, clock: str) -> float:
        return self.step_s if clock == "wall" else self.cpu_s

    @property
    def kind(self) -> str:
        if not self.shape.prefill_chunks:
            return "decode"
        return "mixed" if self.shape.decode_context_lens else "prefill"


class TimingExecutor:
    """Wraps an executor and times each ``execute`` with ``time.perf_counter``; decides nothing."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.last_s = 0.0  # the duration of the latest execute()

    def execute(self, out):
        start = time.perf_counter()
        result = self.inner.execute(out)
        self.last_s = time.perf_counter() - start
        return result


def build_engine(loaded, spec: EngineSpec) -> tuple[LLM, TimingExecutor]:
    """A fresh engine over ``loaded`` with ``spec``'s settings and its executor timed."""
    llm = LLM(loaded, block_size=spec.block_size, num_blocks=spec.num_blocks,
              enable_prefix_caching=spec.enable_prefix_caching, max_num_seqs=spec.max_num_seqs,
              max_num_batched_tokens=spec.max_num_batched_tokens, max_model_len=spec.max_model_len,
              seed=spec.seed)
    timer = TimingExecutor(llm.core.executor)
    llm.core.executor = timer
    return llm, timer


def run_engine(llm: LLM, timer: TimingExecutor,
               before_step: Callable[[list[TimedStep]], None] | None = None) -> list[TimedStep]:
    """Step until every queued request is done; ``before_step(steps so far)`` may add requests."""
    core, steps = llm.core, []
    while core.has_unfinished():
        if before_step is not None:
            before_step(steps)
        cpu_start = time.process_time()
        report = core.step()
        cpu_s = time.process_time() - cpu_start
        steps.append(TimedStep(StepShape.of(report.output), report.end_s - report.start_s, cpu_s, timer.last_s,
                               report.end_s))
    return steps


class StepGrid:
    """The grid's runs on one engine (see the module docstring): each queues its requests and steps the engine
    until they are done, returning every step timed."""

    def __init__(self, llm: LLM, timer: TimingExecutor, cfg: CalibrateConfig) -> None:
        self.llm, self.timer, self.cfg = llm, timer, cfg
        self.rng = np.random.default_rng(cfg.engine.seed)
        self.vocab = llm.config.vocab_size

    def add(self, prompt_len: int, max_tokens: int) -> None:
        core = self.llm.core
        prompt = self.rng.integers(0, self.vocab, prompt_len).tolist()  # random: no prefix is shared
        core.add(core.new_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))

    def warm_up(self) -> None:
        e = self.cfg.engine
        for _ in range(self.cfg.grid.warmup_requests):
            self.add(32, 8)
        self.add(min(e.max_num_batched_tokens, e.max_model_len - 2), 2)  # a full-budget step
        run_engine(self.llm, self.timer)

    def decode_run(self, contexts: tuple[int, ...]) -> list[TimedStep]:
        g = self.cfg.grid
        levels = g.decode_batches
        # A request may be admitted first and decode through every prefill step of the run: give each
        # that many tokens more, so the batch stays full until the last prompt is prefilled.
        head = decode_run_tokens(self.cfg, max(contexts)) - 1 - g.steps_per_batch * len(levels)
        prompt_lens = itertools.cycle(contexts)
        for j, size in enumerate(levels):  # first-admitted requests end first
            for _ in range(size - (levels[j + 1] if j + 1 < len(levels) else 0)):
                self.add(next(prompt_lens), head + g.steps_per_batch * (j + 1))
        mixed = itertools.cycle(g.mixed_prefill_lens)
        decode_steps = 0

        def join(steps: list[TimedStep]) -> None:
            nonlocal decode_steps
            if steps and steps[-1].kind == "decode":
                decode_steps += 1
                if decode_steps % g.steps_per_batch == 0:
                    self.add(next(mixed), 1)

        return run_engine(self.llm, self.timer, join)

    def join_run(self, batch: int, rotate: int = 0) -> list[TimedStep]:
        """``batch`` decodes (prompts cycling through ``spread_contexts`` from index ``rotate``) that the
        groups of :func:`join_pairs` join one per step, every other step, each prompt leaving after its
        prefill: mixed steps of ``batch`` decodes and one or two short chunks, as serving's arrivals make."""
        g = self.cfg.grid
        prompt_lens = itertools.islice(itertools.cycle(g.spread_contexts), rotate, None)
        for _ in range(batch):
            self.add(next(prompt_lens), join_run_tokens(self.cfg, batch))
        joins = iter(join_pairs(g.join_prefill_lens))

        def join(steps: list[TimedStep]) -> None:
            if steps and steps[-1].kind == "decode":  # the whole batch decodes: a join step next
                for n in next(joins, ()):
                    self.add(n, 1)

        return run_engine(self.llm, self.timer, join)

    def lone_prompts(self) -> list[TimedStep]:
        steps = []
        for _ in range(self.cfg.grid.prefill_repeats):
            for n in self.cfg.grid.prefill_lens:
                self.add(n, 1)
                steps += run_engine(self.llm, self.timer)
            lens = itertools.cycle(self.cfg.grid.burst_lens)
            for _ in range(self.cfg.grid.decode_batches[0]):
                self.add(next(lens), 1)
            steps += run_engine(self.llm, self.timer)
        return steps

    def wake_pairs(self) -> WakeCost:
        """Per idle wait, ``wake_pairs`` pairs of the same lone prompt's first ``wake_steps`` steps: served right
        after the previous request (warm) and after sleeping the wait, as a server's loop does between arrivals."""
        g = self.cfg.grid
        pairs = [[[] for _ in range(g.wake_steps)] for _ in g.wake_gaps_ms]
        pickups: list[list[float]] = [[] for _ in g.wake_gaps_ms]
        for _ in range(g.wake_pairs):
            for gap, picked, gap_ms in zip(pairs, pickups, g.wake_gaps_ms):
                self.add(g.wake_prompt_len, g.wake_steps)  # a prefill, then decodes: one step each
                warm = run_engine(self.llm, self.timer)
                arrival = time.perf_counter() + gap_ms / 1000  # the engine's clock (WallClock)
                time.sleep(gap_ms / 1000)
                self.add(g.wake_prompt_len, g.wake_steps)
                woken = run_engine(self.llm, self.timer)
                picked.append(woken[0].end_s - woken[0].step_s - arrival)  # the arrival to its step's start
                for step, w, a in zip(gap, warm, woken):
                    step.append((w.step_s, a.step_s))
        return WakeCost.measured([ms / 1000 for ms in g.wake_gaps_ms], pairs, pickups)

    def _after_prefill_stretches(self, batch: int, prompt_len: int, cell: list[list[tuple[float, float]]],
                                 cell_cpu: list[list[tuple[float, float]]] | None = None) -> None:
        """One batch that a prompt of ``prompt_len`` joins every stretch: ``cell[i]`` gets a (steady, after) pair
        of decode step ``i + 1`` after each join on the wall clock, ``cell_cpu[i]`` the same pair in CPU time."""
        g = self.cfg.grid
        k, stretch = g.after_prefill_steps, g.after_prefill_stretch
        for _ in range(batch):
            self.add(g.after_prefill_context, after_prefill_tokens(self.cfg))
        joins, run = 0, 0

        def join(steps: list[TimedStep]) -> None:
            nonlocal joins, run
            run = run + 1 if steps and steps[-1].kind == "decode" else 0
            if run == stretch and joins < g.after_prefill_repeats:
                self.add(prompt_len, 1)  # its prefill is the next step's; it leaves with that step
                joins += 1

        steps = run_engine(self.llm, self.timer, join)
        for i, s in enumerate(steps):
            after = steps[i + 1:i + 1 + stretch]
            if (s.shape.num_prefill_tokens != prompt_len or len(s.shape.decode_context_lens) != batch
                    or len(after) < stretch or any(a.kind != "decode" for a in after)
                    or any(len(a.shape.decode_context_lens) != batch for a in after)):
                continue  # not a join, or a stretch cut short
            for clock, target in (("wall", cell), ("cpu", cell_cpu)):
                if target is None:
                    continue
                steady = float(np.median([a.seconds(clock) for a in after[k:]]))
                for step, a in zip(target, after):
                    step.append((steady, a.seconds(clock)))

    def after_prefill_by_clock(self) -> dict[str, AfterPrefillCost]:
        """Per decode batch size and joining prompt length, ``after_prefill_repeats`` stretches of decode steps
        after the prompt's prefill: each of the first ``after_prefill_steps`` against the median of the same
        stretch's later steps (the steady state, a few tokens of context on), on each clock of :data:`CLOCKS`
        from the same steps. A fit on one clock takes off the aftermath measured on that clock: on a loaded
        machine the wall clock's aftermath is several times a step's CPU time."""
        g = self.cfg.grid

        def empty():
            return [[[[] for _ in range(g.after_prefill_steps)] for _ in g.after_prefill_lens]
                    for _ in g.after_prefill_batches]

        pairs = {clock: empty() for clock in CLOCKS}
        for b, batch in enumerate(g.after_prefill_batches):
            for p, prompt_len in enumerate(g.after_prefill_lens):
                self._after_prefill_stretches(batch, prompt_len, pairs["wall"][b][p], pairs["cpu"][b][p])
        return {clock: AfterPrefillCost.measured(g.after_prefill_batches, g.after_prefill_lens, pairs[clock])
                for clock in CLOCKS}

    def after_prefill(self) -> AfterPrefillCost:
        """:meth:`after_prefill_by_clock`'s wall-clock cost (the runs are served again)."""
        return self.after_prefill_by_clock()["wall"]


def calibration_steps(loaded, cfg: CalibrateConfig) -> tuple[list[TimedStep], WakeCost, AfterPrefillCost]:
    """Serve the grid on one engine (see the module docstring): every timed step (warm-up, wake pairs and
    after-prefill runs excluded), the wake pairs' cost of waking an idle engine, and the after-prefill runs'
    cost of a prefill to the decode steps after it (wall clock; :func:`calibration_steps_by_clock` gives both)."""
    steps, wake, after = calibration_steps_by_clock(loaded, cfg)
    return steps, wake, after["wall"]


def calibration_steps_by_clock(loaded, cfg: CalibrateConfig) -> tuple[list[TimedStep], WakeCost,
                                                                     dict[str, AfterPrefillCost]]:
    """:func:`calibration_steps` with the after-prefill cost on each clock (:meth:`StepGrid.after_prefill_by_clock`)."""
    llm, timer = build_engine(loaded, cfg.engine)
    grid = StepGrid(llm, timer, cfg)
    grid.warm_up()
    steps = []
    for context in cfg.grid.decode_contexts:
        steps += grid.decode_run((context,))
    steps += grid.decode_run(cfg.grid.spread_contexts)
    for j, batch in enumerate(cfg.grid.join_batches):
        steps += grid.join_run(batch, rotate=3 * j)
    steps += grid.lone_prompts()
    return steps, grid.wake_pairs(), grid.after_prefill_by_clock()


def samples_of(steps: Sequence[TimedStep], clock: str = "wall",
               after: AfterPrefillCost | None = None) -> list[StepSample]:
    """The steps (in the order they ran) as fit samples; with ``after``, each less the extra time a prefill
    before it costs it (the shape's steady-state time), floored as :func:`steady_samples` says."""
    return list(steady_samples(steps, clock, after).samples)


def predicted_s(cost, steps: Sequence[TimedStep], after: AfterPrefillCost | None = None) -> np.ndarray:
    """``cost``'s time of each of ``steps`` (in the order they ran): its shape's, plus with ``after`` the
    extra of a decode step after a prefill, as the serving simulator charges it (:class:`PricedAfterPrefill`)."""
    base = np.array([cost.step_time_s(step_batch(s.shape)) for s in steps], dtype=float)
    if after is None or not steps:
        return base
    return base + np.array(priced_after(after, cost).extras_in_order(s.shape for s in steps))


def error_summary(errors: np.ndarray) -> dict[str, float | int]:
    """Relative errors (predicted / measured - 1) summarised: sizes of the misses, and their bias."""
    a = np.abs(errors)
    if not len(a):
        return {"num_samples": 0}
    return {"num_samples": len(a), "median_abs": float(np.median(a)), "p90_abs": float(np.quantile(a, 0.9)),
            "max_abs": float(a.max()), "rms": float(np.sqrt(np.mean(errors ** 2))),
            "median_signed": float(np.median(errors))}


def fit_errors(cost: StepCostModel | BatchedStepCost, steps: Sequence[TimedStep],
               clock: str = "wall", after: AfterPrefillCost | None = None) -> dict[str, dict]:
    """:func:`error_summary` of ``cost`` (and ``after``) on ``steps``: all of them and each kind."""
    errors = predicted_s(cost, steps, after) / np.array([s.seconds(clock) for s in steps]) - 1.0
    kinds = np.array([s.kind for s in steps])
    return {"all": error_summary(errors), **{k: error_summary(errors[kinds == k]) for k in KINDS}}


#: buckets of "decode steps since the last step with a prefill chunk" (1: the decode step right after it)
SINCE_PREFILL = ((1, 1), (2, 2), (3, 3), (4, 7), (8, None))


def decode_errors_since_prefill(cost, runs: Sequence[Sequence[TimedStep]], clock: str = "wall",
                                after: AfterPrefillCost | None = None) -> list[dict]:
    """``cost``'s (with ``after``'s extras) relative error on the decode-only steps of ``runs`` (each in step
    order), by how many decode steps have run since the last step with a prefill chunk (a run's first steps
    before any prefill count as far from one). A shape prices a step alone: a trend down the buckets is a
    cost that depends on what ran before, which ``after`` is there to price."""
    since, rows = [], []
    for steps in runs:
        n = 1 << 30
        for s, predicted in zip(steps, predicted_s(cost, steps, after)):
            if s.kind != "decode":
                n = 0
                continue
            n += 1
            since.append(n)
            rows.append((predicted / s.seconds(clock) - 1.0, s.seconds(clock)))
    since_a, err = np.array(since), np.array(rows).reshape(-1, 2)
    out = []
    for lo, hi in SINCE_PREFILL:
        mask = (since_a >= lo) & (since_a <= (hi if hi is not None else since_a.max(initial=0)))
        label = str(lo) if hi == lo else (f"{lo}-{hi}" if hi is not None else f"{lo}+")
        out.append({"since_prefill": label, "num_steps": int(mask.sum()),
                    "median_signed": float(np.median(err[mask, 0])) if mask.any() else None,
                    "median_step_s": float(np.median(err[mask, 1])) if mask.any() else None})
    return out


def constant_fit(steps: Sequence[TimedStep], clock: str = "wall") -> float:
    """The one step time closest to every step (least squares on relative error): the baseline a
    step-cost model must beat."""
    y = np.array([s.seconds(clock) for s in steps])
    return float(np.sum(1 / y) / np.sum(1 / y ** 2))


def fit(steps: Sequence[TimedStep], clock: str = "wall", *, batched: bool = True,
        after: AfterPrefillCost | None = None) -> StepCostModel | BatchedStepCost:
    """:func:`fit_batched_profile` (``batched``: the CPU default backend's nine terms) or :func:`fit_profile`
    (the five linear terms) on the steps' ``clock`` durations, less ``after``'s extras (see :func:`samples_of`)."""
    less = ", less a prefill's cost to the decode steps after it" if after is not None else ""
    terms = "batched" if batched else "linear"
    label = f"CPU engine fit to {len(steps)} timed steps ({clock} clock, {terms} terms{less})"
    return (fit_batched_profile if batched else fit_profile)(samples_of(steps, clock, after), label=label)


def median_rescaled(cost, steps: Sequence[TimedStep], clock: str = "wall", after: AfterPrefillCost | None = None):
    """``cost`` with every coefficient scaled so that its median relative error on ``steps`` (with ``after``'s
    extras charged as they are, unscaled, within the bounds the scaled model prices them at) is 0.

    A diagnostic: least squares on relative error under-predicts a typical step when the timings are
    noisy (the best constant for ``y`` is ``sum(1/y) / sum(1/y^2)``, below the median), so this is
    the same model at a level the noise does not pull down.
    """
    base = predicted_s(cost, steps)
    raw = np.array(after.extras_in_order(s.shape for s in steps)) if after is not None else np.zeros(len(steps))
    measured = np.array([s.seconds(clock) for s in steps])
    share = MIN_STEADY_SHARE

    def median_ratio(scale: float) -> float:  # increasing in scale: every step's ratio is
        # the extras bounded as the scaled model charges them (PricedAfterPrefill: by the scaled shape's cost)
        extra = np.clip(raw, -(1.0 - share) * scale * base, (1.0 / share - 1.0) * scale * base)
        return float(np.median((scale * base + extra) / measured))

    # 1 / median(predicted / measured), not median(measured / predicted): the two differ for an even count;
    # with extras the scale has no closed form, so it is bisected (the median of increasing functions increases)
    ratio = 1.0 / median_ratio(1.0)
    if after is not None:
        lo, hi = 0.0, 2.0 * ratio
        while median_ratio(hi) < 1.0:
            hi *= 2.0
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if median_ratio(mid) < 1.0 else (lo, mid)
        ratio = 0.5 * (lo + hi)
    scaled = {t: getattr(cost, t) * ratio for t in terms_of(cost)}
    return dataclasses.replace(cost, label=f"{cost.label}, rescaled x{ratio:.3f} to median error 0", **scaled)
