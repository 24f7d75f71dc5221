"""A run of simulated steps on the serving simulator's clock: the steps' ends, with the arrivals and
the window a step-by-step run would see (:func:`clock_steps`), and decode steps' durations without
building each step's shape (:func:`decode_run_of`). Shared by the fast-forward's runs
(:mod:`pagedbench.bench.sim.fast_forward`, :mod:`pagedbench.bench.sim.decode_session`)."""

from __future__ import annotations

import math
from collections.abc import Callable

from pagedbench.refengine.engine.core import StepShape


def clock_steps(run, k_max: int, duration: Callable[[int], float] | float) -> list[float]:
    """Move the run's clock over up to ``k_max`` steps, step ``k`` lasting ``duration(k)`` (or ``duration``
    itself, a float: every step's), with the arrivals step-by-step simulation would see at each step's
    start; returns each step's end (the time its tokens are out). Fewer steps when a step would start past
    the window without drain or at an arrival with the queue empty (it could be admitted), or after a step
    that the overload test of a step-by-step run would look at (``SimRun._count``): one that
    ends past the window, or (``stop_on_overload``) one an arrival preceded.

    The time is added up in a local float, step by step as the clock's own ``advance`` adds it (the same
    floats), and the clock is moved there before each arrival and at the end."""
    clock, sched = run.clock, run.sched
    next_arrival = run.pending[0].arrival_s if run.pending else math.inf
    stop_after = math.inf if run.cfg.drain else run.window[1]
    closes_window = math.inf if run.window_closed else run.window[1]
    watch_arrivals = run.cfg.stop_on_overload
    constant = duration if type(duration) is float else None
    if constant is not None and constant < 0:
        raise ValueError(f"a clock cannot go back: advance({constant})")
    t = clock.now()
    step_ends = []
    for k in range(k_max):
        cut = False
        if k:
            if t > stop_after:
                break
            if t >= next_arrival:
                if not sched.waiting:
                    break
                # behind a head that cannot be admitted, an arrival only joins the queue (a new request
                # is the youngest): the run goes on
                clock.advance_to(t)
                run._arrive()
                next_arrival = run.pending[0].arrival_s if run.pending else math.inf
                cut = watch_arrivals
        if constant is None:
            d = duration(k)
            if d < 0:
                raise ValueError(f"a clock cannot go back: advance({d})")
            t += d
        else:
            t += constant
        step_ends.append(t)
        if cut or t > closes_window:
            break
    clock.advance_to(t)
    return step_ends


def decode_run_of(step_time_s: Callable[[StepShape], float]) -> Callable[[tuple[int, ...]], Callable[[int], float]]:
    """``decode_run(context_lens)``: the duration of step ``j`` of a run of decode-only steps from those
    context lengths (each one token longer a step), as a function of ``j``; the same float
    ``step_time_s(StepShape((), tuple(c + j for c in context_lens)))`` gives. A step-time function may
    carry its own as ``step_time_s.decode_run`` (at O(1) a step where the shape costs O(batch) to
    build); this is the general one."""
    own = getattr(step_time_s, "decode_run", None)
    if own is not None:
        return own

    def decode_run(context_lens: tuple[int, ...]) -> Callable[[int], float]:
        return lambda j: step_time_s(StepShape((), tuple(map(j.__add__, context_lens))))

    return decode_run
