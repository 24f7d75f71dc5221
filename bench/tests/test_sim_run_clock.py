"""A run's clock (:func:`pagedbench.bench.sim.run_clock.clock_steps`) stops where a step-by-step run's loop
would look: after the first step ending past the window (its overload test), before a step starting past
the window without drain, and before a step starting at an arrival the empty queue could admit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from pagedbench.bench.sim.run_clock import clock_steps
from pagedbench.refengine.engine.core import SimClock


def _run(window_end: float, *, drain: bool = True, closed: bool = False, arrivals=(), waiting=()):
    run = SimpleNamespace(clock=SimClock(), sched=SimpleNamespace(waiting=list(waiting)),
                          pending=[SimpleNamespace(arrival_s=a) for a in arrivals],
                          cfg=SimpleNamespace(drain=drain, stop_on_overload=False),
                          window=(0.0, window_end), window_closed=closed)
    run._arrive = lambda: run.pending.pop(0)
    return run


@pytest.mark.parametrize("window_end,steps", [(1.2, 3), (1.0, 3), (0.99, 2), (0.5, 2), (0.49, 1)])
def test_the_run_ends_with_the_step_that_ends_past_the_window(window_end, steps):
    run = _run(window_end)  # steps of 0.5 s end at 0.5, 1.0, 1.5, ...: the first past the window is the last
    assert clock_steps(run, 10, 0.5) == [0.5 * (i + 1) for i in range(steps)]
    assert run.clock.now() == 0.5 * steps
    # the same with a duration per step
    assert clock_steps(_run(window_end), 10, lambda k: 0.5) == [0.5 * (i + 1) for i in range(steps)]


def test_a_closed_window_ends_no_run():
    assert len(clock_steps(_run(1.2, closed=True), 10, 0.5)) == 10


def test_without_drain_no_step_starts_past_the_window():
    # (the window already closed, the overload test looks at no step) steps start at 0, 0.5 and 1.0; the
    # next would start at 1.5, past the window's end 1.2
    run = _run(1.2, drain=False, closed=True)
    assert clock_steps(run, 10, 0.5) == [0.5, 1.0, 1.5]


def test_an_arrival_ends_the_run_when_the_queue_is_empty_and_joins_it_otherwise():
    run = _run(math.inf, arrivals=[1.0, 1.2])
    assert clock_steps(run, 10, 0.5) == [0.5, 1.0]  # the next step starts at the arrival: it may admit it
    run = _run(math.inf, arrivals=[1.0, 1.2], waiting=["head"])
    assert clock_steps(run, 4, 0.5) == [0.5, 1.0, 1.5, 2.0] and not run.pending  # both arrived on the way
