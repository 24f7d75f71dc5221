"""The overload test on traces whose fate is known by hand: a queue that must diverge, one that must not,
and a fixed-count trace whose latency plateaus (the old method's false capacity)."""

from __future__ import annotations

import math

import pytest
from pagedbench.bench.sim.capacity_search import find_capacity
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, constant_step, simulate
from pagedbench.bench.workloads import Request

PAGED = AllocatorSpec("paged", 4)


def every(gap_s: float, span_s: float) -> tuple[Request, ...]:
    """One request (prompt 1, 4 tokens) every ``gap_s`` seconds over ``span_s``."""
    return tuple(Request(i, 1, 4, i * gap_s) for i in range(math.ceil(span_s / gap_s)))


def cfg(**kw) -> SimConfig:
    # one sequence at a time and 1 s per step: a request takes 4 s, so the service rate is 0.25 req/s
    return SimConfig(kv_slots=64, max_seq_len=8, watermark=0.0, max_num_seqs=1, warmup_frac=0.1, **kw)


def test_a_queue_that_must_diverge_is_overloaded_and_stopped_early():
    trace = every(2.0, 400.0)  # 0.5 req/s offered against 0.25 served
    full = simulate(trace, PAGED, cfg(span_s=400.0), step_time_s=constant_step(1.0))
    o = full.overload
    assert o.window_s == (40.0, 400.0) and o.num_arrivals == 180
    assert o.achieved_rate == pytest.approx(0.25, abs=0.01) and o.offered_rate == pytest.approx(0.5)
    assert o.overloaded and o.backlog_growth > o.allowance == 3 * math.sqrt(180)
    stopped = simulate(trace, PAGED, cfg(span_s=400.0, stop_on_overload=True), step_time_s=constant_step(1.0))
    assert stopped.overload.overloaded and stopped.overload.stopped_early
    assert stopped.simulated_s < 0.6 * full.simulated_s  # stopped once the backlog passed twice the allowance
    assert stopped.overload.backlog_growth > 2 * stopped.overload.allowance


def test_a_stable_queue_is_not_overloaded_and_every_measured_request_finishes():
    trace = every(5.0, 400.0)  # 0.2 req/s against 0.25
    r = simulate(trace, PAGED, cfg(span_s=400.0, stop_on_overload=True), step_time_s=constant_step(1.0))
    assert not r.overload.overloaded and not r.overload.stopped_early
    assert len(r.requests) == r.overload.num_arrivals == 72 and all(t.finished for t in r.requests)
    assert r.overload.achieved_rate == pytest.approx(0.2, abs=0.01)


def test_a_fixed_count_plateau_is_never_a_capacity():
    count = 200

    def run(rate: float, stop: bool = False):  # the old method: a fixed count of requests at any rate
        trace = tuple(Request(i, 1, 4, i / rate) for i in range(count))
        return simulate(trace, PAGED, cfg(stop_on_overload=stop), step_time_s=constant_step(1.0))

    low = run(0.01).mean_normalized_latency_s
    limit = 200 * low  # a lenient threshold: the plateau (about 100x) sits below it
    # far past the service rate, the queue is capped at 200 requests: latency levels off below the limit
    plateau = [run(rate).mean_normalized_latency_s for rate in (4.0, 40.0, 400.0)]
    assert max(plateau) < limit and plateau[2] == pytest.approx(plateau[1], rel=0.05)

    def passes(rate: float) -> bool:
        r = run(rate, stop=True)
        return not r.overload.overloaded and r.mean_normalized_latency_s <= limit

    assert all(run(rate).overload.overloaded for rate in (4.0, 40.0, 400.0))
    old = find_capacity(lambda rate: run(rate).mean_normalized_latency_s <= limit, 0.01, max_rate=1e3)
    assert old.rate is None and "still holds" in old.reason  # latency alone: the plateau passes everywhere
    cap = find_capacity(passes, 0.01, steps=6)
    # the service rate is 0.25 req/s; with 180 arrivals in the window the test allows the backlog to grow
    # by 3 sqrt(180) = 40 requests, so a rate up to 0.25 x 180 / (180 - 40) = 0.32 may pass, no higher
    assert cap.rate is not None and 0.2 < cap.rate <= 0.25 * 180 / (180 - 3 * math.sqrt(180))


@pytest.mark.parametrize(("kw", "message"), [
    ({"span_s": 0.0}, "span_s must be > 0 seconds"),
    ({"span_s": -5.0}, "span_s must be > 0 seconds"),
    ({"warmup_frac": 0.6, "cooldown_frac": 0.4}, "leave a window"),
])
def test_bad_spans_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(**kw)


def test_a_trace_past_its_span_is_refused():
    with pytest.raises(ValueError, match=r"last arrival \(12.0 s\) is past its span_s \(10.0 s\)"):
        simulate((Request(0, 1, 2, 12.0),), PAGED, cfg(span_s=10.0))
