"""Serving a request trace with the real scheduler and KV manager, on a simulated clock.

No model runs. Each request of the trace becomes a request of :class:`~pagedbench.refengine.engine.core.
EngineCore` with ``max_tokens = output_len`` (and ``ignore_eos``); the loop is the engine's own
(``Scheduler -> SimulatedExecutor -> Scheduler.update``), so admission, chunked or separate prefill,
preemption (recompute) and the block accounting are exactly the engine's. A step lasts what
``step_time_s(StepShape)`` says: a constant, or the step-cost model of a GPU
(:mod:`pagedbench.bench.costmodel`). Idle time (nothing running or waiting) jumps to the next arrival;
a step-time function that prices waking an idle engine (``step_time_s.wake_s``, see
:mod:`pagedbench.bench.costmodel.wake_cost`) makes the jump end its pick-up time past the arrival and the
first steps after it that much longer, and one
that prices the decode steps after a prefill (``step_time_s.after_prefill_s``, see
:mod:`pagedbench.bench.costmodel.after_prefill`) the first decode steps after each step with a prefill chunk.
A request may be a group (``group=``): ``n`` parallel samples, or a beam search replaying recorded
trajectories (:mod:`pagedbench.bench.sim.group_replay`); it completes when its last sequence does.

The KV manager is the paged :class:`~pagedbench.refengine.BlockManager` (kept ``watermark`` of its
blocks free at admission, as vLLM does) or Orca's contiguous reservations
(:class:`~pagedbench.refengine.ContiguousBlockManager`: Max, Pow2, Oracle, on a buddy or first-fit arena).

The run itself (its window, the overload test) is :class:`~pagedbench.bench.sim.run.SimRun`'s;
the memory accounting is :mod:`pagedbench.bench.sim.accounting`'s.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

from pagedbench.bench.sim.group_replay import GroupSpec
from pagedbench.bench.sim.records import AllocatorSpec, CopyRecord, Overload, Shares, SimConfig, SimResult, StepRecord
from pagedbench.bench.sim.run import SimRun, default_manager
from pagedbench.bench.sim.sharing import sharing_saving
from pagedbench.bench.workloads import Request
from pagedbench.refengine.engine.core import StepShape

__all__ = ["AllocatorSpec", "CopyRecord", "Overload", "Shares", "SimConfig", "SimResult", "StepRecord", "constant_step",
           "sharing_saving", "simulate"]

#: the private names of the flat ``serving_sim`` module, for its callers
_Run, _manager = SimRun, default_manager


def constant_step(step_s: float) -> Callable[[StepShape], float]:
    """Every step lasts ``step_s`` (with the ``decode_run`` a fast-forward asks for: see
    :func:`pagedbench.bench.sim.fast_forward.decode_run_of`)."""

    def step_time_s(shape: StepShape) -> float:
        return step_s

    step_time_s.decode_run = lambda context_lens: lambda j: step_s
    step_time_s.constant_s = step_s  # whatever the shape (a fast-forward's runs need not build it)
    return step_time_s


def simulate(trace: tuple[Request, ...], spec: AllocatorSpec, cfg: SimConfig = SimConfig(), *,
             step_time_s: Callable[[StepShape], float] | None = None, record_steps: bool = False,
             account: bool = True, prompt_tokens: Callable[[Request], list[int]] | None = None,
             on_step: Callable[[], None] | None = None,
             make_manager: Callable[[AllocatorSpec, SimConfig], object] | None = None,
             fast_forward: bool = True, group: GroupSpec | None = None) -> SimResult:
    """Serve ``trace`` with ``spec``'s KV manager under ``cfg`` (see the module docstring).

    ``step_time_s``: each step's duration from its shape (default: ``cfg.step_s``, constant).
    ``account=False`` skips the memory accounting (shares and mean batch stay 0; the latency does not
    need them). ``prompt_tokens(request)``: the prompt's token ids (default: zeros; what matters to a
    simulation is their number, unless prefix caching is on). ``make_manager(spec, cfg)``: builds the KV
    manager in place of the default one for ``spec`` (a recording subclass, say). ``fast_forward``: serve
    runs of decode steps in one go (:mod:`pagedbench.bench.sim.fast_forward`; the same schedule, and
    ``on_step`` is then called once per run), unless the memory is accounted or steps recorded.
    ``group``: each request's decoding (:class:`~pagedbench.bench.sim.group_replay.GroupSpec`: ``n`` parallel
    samples, or a replayed beam search); a group's latency runs to its last sequence's end.
    """
    run = SimRun(trace, spec, cfg, step_time_s or constant_step(cfg.step_s), record_steps, account,
               prompt_tokens, make_manager, fast_forward, group)
    if on_step is not None and run.fast is not None:
        run.fast.lazy = False  # on_step may read the running sequences: each run leaves them told
        run.chain_runs = False  # and is called after each run
    with _no_cycle_collection():
        while run.step():
            if on_step is not None:
                on_step()
        result = run.result()
        run.core.executor.run = None  # its one cycle (run, core, executor, run) broken: freed at once
        del run
    return result


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector paused (as it was after). A run's objects live until it ends (then freed
    by their reference counts, its one cycle broken) and its steps leave no cycles behind, so every
    collection mid-run would find nothing and only walk the run's live requests again (and whatever the
    caller keeps: a study holding an earlier run's result), a tenth of a fast-forwarded run's time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
