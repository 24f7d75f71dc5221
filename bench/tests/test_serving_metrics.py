"""Per-request metrics and their summary, hand-computed on a three-request trace served by the simulator."""

from __future__ import annotations

import pytest
from pagedbench.bench.common.serving_metrics import MetricsError, RequestTiming, request_metrics, summarize
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.bench.workloads import Request

# A at 0 (prompt 2, 3 tokens), B at 0.5 (prompt 3, 2 tokens), C at 2.5 (prompt 3, 1 token); a step lasts
# 0.5 s per token it computes (mixed policy, room for all):
#   [0, 1]     A's prompt (2 tokens)                 -> A1 at 1.0
#   [1, 3]     A decode + B's prompt (1 + 3)          -> A2, B1 at 3.0
#   [3, 5.5]   A, B decode + C's prompt (1 + 1 + 3)   -> A3, B2, C1 at 5.5
TRACE = (Request(0, 2, 3, 0.0), Request(1, 3, 2, 0.5), Request(2, 3, 1, 2.5))


def served():
    cfg = SimConfig(kv_slots=64, max_seq_len=16, watermark=0.0, warmup_frac=0.0, span_s=3.0)
    return simulate(TRACE, AllocatorSpec("paged", 4), cfg, step_time_s=lambda shape: 0.5 * shape.num_tokens)


def test_three_request_trace_hand_computed():
    r = served()
    assert [(t.first_scheduled_s, t.token_times_s) for t in r.requests] == [
        (0.0, (1.0, 3.0, 5.5)), (1.0, (3.0, 5.5)), (3.0, (5.5,))]
    a, b, c = (request_metrics(t) for t in r.requests)
    assert (a.ttft_s, a.tpot_s, a.itl_s, a.e2el_s, a.queue_s) == (1.0, 2.25, (2.0, 2.5), 5.5, 0.0)
    assert (b.ttft_s, b.tpot_s, b.itl_s, b.e2el_s, b.queue_s) == (2.5, 2.5, (2.5,), 5.0, 0.5)
    # one token: no TPOT (the first token is excluded, as vLLM and SGLang count it), no ITL
    assert (c.ttft_s, c.tpot_s, c.itl_s, c.e2el_s, c.queue_s) == (3.0, None, (), 3.0, 0.5)
    s = summarize([a, b, c], 3.0)
    assert s["completed"] == 3 and s["request_throughput"] == 1.0 and s["output_throughput"] == 2.0
    assert s["mean_ttft_ms"] == pytest.approx(6500 / 3) and s["median_ttft_ms"] == 2500
    assert s["p90_ttft_ms"] == pytest.approx(2900) and s["p99_ttft_ms"] == pytest.approx(2990)  # linear
    assert s["mean_tpot_ms"] == pytest.approx(2375) and s["p99_tpot_ms"] == pytest.approx(2497.5)
    assert s["mean_itl_ms"] == pytest.approx(7000 / 3) and s["p50_itl_ms"] == 2500  # every gap
    assert s["mean_e2el_ms"] == pytest.approx(4500) and s["p99_e2el_ms"] == pytest.approx(5490)
    assert s["mean_queue_ms"] == pytest.approx(1000 / 3)
    assert s["mean_normalized_latency_s"] == pytest.approx((5.5 / 3 + 5.0 / 2 + 3.0) / 3)


def test_measured_requests_are_those_arriving_in_the_window():
    cfg = SimConfig(kv_slots=64, max_seq_len=16, watermark=0.0, warmup_frac=0.1, cooldown_frac=0.1, span_s=3.0)
    r = simulate(TRACE, AllocatorSpec("paged", 4), cfg, step_time_s=lambda shape: 0.5 * shape.num_tokens)
    assert [t.request_id for t in r.requests] == [1, 2]  # window [0.3, 2.7]: A arrived in the warm-up
    assert r.overload.window_s == pytest.approx((0.3, 2.7)) and r.overload.num_arrivals == 2
    cfg = SimConfig(kv_slots=64, max_seq_len=16, watermark=0.0, warmup_frac=0.0, cooldown_frac=0.5, span_s=3.0)
    r = simulate(TRACE, AllocatorSpec("paged", 4), cfg, step_time_s=lambda shape: 0.5 * shape.num_tokens)
    assert [t.request_id for t in r.requests] == [0, 1]  # C arrived in the cool-down: served, not measured


@pytest.mark.parametrize(("timing", "message"), [
    (RequestTiming(0, 1.0, 3, 2, 1.5, (2.0,)), "1 of 2 tokens out"),
    (RequestTiming(0, 1.0, 3, 1, 0.5, (2.0,)), "first_scheduled_s must be >= arrival_s 1.0, got 0.5"),
    (RequestTiming(0, 1.0, 3, 2, 1.0, (3.0, 2.0)), "non-decreasing"),
])
def test_bad_timings_are_refused(timing, message):
    with pytest.raises(MetricsError, match=message):
        request_metrics(timing)


def test_summary_refuses_a_bad_duration_and_percentile():
    m = request_metrics(RequestTiming(0, 0.0, 1, 1, 0.0, (1.0,)))
    with pytest.raises(MetricsError, match="duration_s must be a positive"):
        summarize([m], 0.0)
    with pytest.raises(MetricsError, match="percentiles must be in"):
        summarize([m], 1.0, percentiles=(101,))
    assert summarize([], 1.0)["mean_ttft_ms"] is None
