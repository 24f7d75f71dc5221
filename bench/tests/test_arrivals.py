"""Arrival patterns: their rates and shapes, determinism by seed, and trace replay's time scale."""

from __future__ import annotations

import numpy as np
import pytest
from pagedbench.bench.workloads import Request, arrivals

N = 20_000


@pytest.mark.parametrize("pattern, burstiness, cv", [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0),
                                                     ("gamma", 4.0, 0.5), ("constant", 1.0, 0.0)])
def test_mean_gap_is_one_over_rate_and_burstiness_sets_the_spread(pattern, burstiness, cv):
    t = arrivals.arrival_times(pattern, N, 5.0, burstiness=burstiness, seed=3)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.min() >= 0
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, abs=0.06)


def test_same_seed_same_times_other_seed_other_times():
    a = arrivals.arrival_times("gamma", 50, 2.0, burstiness=0.5, seed=1)
    assert np.array_equal(a, arrivals.arrival_times("gamma", 50, 2.0, burstiness=0.5, seed=1))
    assert not np.array_equal(a, arrivals.arrival_times("gamma", 50, 2.0, burstiness=0.5, seed=2))
    assert np.array_equal(arrivals.arrival_times("constant", 3, 2.0), [0.5, 1.0, 1.5])


def test_replay_scales_timestamps_and_hits_a_target_rate():
    trace = (Request(0, 3, 2, 1.0), Request(1, 3, 2, 3.0), Request(2, 3, 2, 5.0))
    assert arrivals.mean_rate(trace) == pytest.approx(0.5)
    half = arrivals.replay(trace, 0.5)
    assert [r.arrival_s for r in half] == [0.5, 1.5, 2.5]
    assert [(r.request_id, r.prompt_len) for r in half] == [(0, 3), (1, 3), (2, 3)]
    scale = arrivals.time_scale_for_rate(trace, 2.0)
    assert scale == pytest.approx(0.25)
    assert arrivals.mean_rate(arrivals.replay(trace, scale)) == pytest.approx(2.0)


def test_with_arrivals_sets_times_in_order():
    trace = (Request(0, 3, 2), Request(1, 4, 1))
    assert arrivals.with_arrivals(trace, [0.5, 2.0]) == (Request(0, 3, 2, 0.5), Request(1, 4, 1, 2.0))
    with pytest.raises(ValueError, match=r"one arrival time per request \(2\), got 1"):
        arrivals.with_arrivals(trace, [0.5])
    with pytest.raises(ValueError, match="non-decreasing"):
        arrivals.with_arrivals(trace, [2.0, 0.5])


@pytest.mark.parametrize("call, message", [
    (lambda: arrivals.arrival_times("uniform", 3, 1.0), "unknown arrival pattern 'uniform'; known: poisson"),
    (lambda: arrivals.arrival_times("gamma", 0, 1.0), "num_requests must be an int >= 1, got 0"),
    (lambda: arrivals.arrival_times("gamma", 3, -1.0), "rate must be a finite number > 0 requests/s, got -1.0"),
    (lambda: arrivals.arrival_times("gamma", 3, 1.0, burstiness=0), "burstiness must be a finite number > 0"),
    (lambda: arrivals.arrival_times("poisson", 3, 1.0, burstiness=2.0), "poisson arrivals have burstiness 1"),
    (lambda: arrivals.replay((Request(0, 1, 1),), 0.0), "time_scale must be a finite number > 0, got 0.0"),
    (lambda: arrivals.mean_rate((Request(0, 1, 1), Request(1, 1, 1))), "the trace has no rate"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
