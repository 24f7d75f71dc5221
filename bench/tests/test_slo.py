"""SLO presets, user-given SLOs, attainment and goodput, and the capacity search on a known knee."""

from __future__ import annotations

import pytest
from pagedbench.bench.common.serving_metrics import RequestMetrics
from pagedbench.bench.common.slo import PRESETS, SLOError, attainment, parse_slo, request_goodput, slo_met
from pagedbench.bench.sim.capacity_search import compare, estimate, find_capacity


def metrics(ttft_s: float, tpot_s: float | None) -> RequestMetrics:
    return RequestMetrics(0, 10, 5, ttft_s, tpot_s, (), ttft_s + 4 * (tpot_s or 0), 0.0)


def test_presets_hold_the_published_limits():
    mlperf = PRESETS["mlperf-llama-3.1-8b"]
    assert [(t.metric, t.limit_ms, t.share) for t in mlperf.targets] == [("ttft", 2000, 0.99), ("tpot", 100, 0.99)]
    assert [(t.limit_ms, t.share) for t in PRESETS["mlperf-llama-2-70b-interactive"].targets] == [(450, .99), (40, .99)]
    assert [t.share for t in PRESETS["distserve-llama-3.1-8b"].targets] == [0.9, 0.9]


def test_attainment_goodput_and_a_user_slo():
    slo = parse_slo("ttft:p90:1000,tpot:p50:50")
    ms = [metrics(0.5, 0.04)] * 8 + [metrics(1.5, 0.04), metrics(0.5, 0.06)]
    assert attainment(ms, slo) == {"ttft": 0.9, "tpot": 0.9}
    assert slo_met(ms, slo)
    assert not slo_met(ms, slo, num_unfinished=1)  # an unfinished request misses every target: 9/11 < 0.9
    assert request_goodput(ms, slo, 2.0) == 8 / 2.0  # requests meeting every target, per second
    assert slo_met([metrics(0.5, None)], slo)  # a one-token request has no TPOT to miss


@pytest.mark.parametrize(("text", "message"), [
    ("mlperf-llama-9", "unknown SLO preset 'mlperf-llama-9'; known: mlperf-llama-3.1-8b, "),
    ("ttft:99:2000", "expected 'metric:pNN:limit_ms'"),
    ("latency:p99:2000", "unknown SLO metric 'latency'; known: ttft, tpot, itl, e2el, queue"),
    ("ttft:p99:-1", "limit for ttft must be > 0 ms, got -1.0"),
    ("ttft:p120:10", "share for ttft must be in \\(0, 1\\], got 1.2"),
])
def test_bad_slos_name_what_is_known(text, message):
    with pytest.raises(SLOError, match=message):
        parse_slo(text)


def test_capacity_search_finds_a_known_knee():
    knee, seen = 7.3, []

    def passes(rate):
        seen.append(rate)
        return rate <= knee

    c = find_capacity(passes, 0.1, factor=4, steps=8)
    assert c.rate <= knee < c.bracket[1] and c.bracket[1] / c.rate <= 4 ** (2 ** -8) * 1.0001
    assert c.rate == max(r for r in seen if r <= knee)  # a rate that was run and passed, never a bound
    assert find_capacity(lambda r: False, 1.0).rate is None  # fails at once: no capacity
    assert find_capacity(lambda r: True, 1.0, max_rate=100).rate is None  # never fails: no bound either


def test_seed_intervals_and_ties():
    a, b = estimate([10.0, 11.0, 12.0]), estimate([11.5, 12.5, 13.5])
    assert a.mean == 11.0 and a.low == pytest.approx(11 - 4.303 * 1 / 3 ** 0.5)
    assert compare(a, b) == "tie"  # the intervals overlap
    assert compare(estimate([20.0, 20.5, 21.0]), a) == "higher"
    assert compare(estimate([10.0]), estimate([10.3])) == "tie"


def test_paired_ratio_cancels_the_seeds_noise_and_keeps_the_bisections_resolution():
    from pagedbench.bench.sim.capacity_search import ratio_estimate

    # both managers see the same arrivals per seed: the capacities move together, their ratio does not
    ours, theirs = [(20.0, 21.0), (30.0, 31.5), (40.0, 42.0)], [(10.0, 10.5), (15.0, 15.75), (20.0, 21.0)]
    e = ratio_estimate(ours, theirs)
    assert e.mean == pytest.approx(2.0) and e.low == pytest.approx(2.0 / 1.05) and e.high == pytest.approx(2.1)
    assert compare(estimate([20, 30, 40]), estimate([10, 15, 20])) == "tie"  # unpaired, the same data: a tie
    tie = ratio_estimate([(10.0, 11.0)] * 3, [(10.0, 11.0)] * 3)
    assert tie.low < 1 < tie.high  # equal capacities: the bisection's bracket makes it a tie
    with pytest.raises(ValueError, match="same seeds on both sides, got 1 and 2"):
        ratio_estimate([(1.0, 2.0)], [(1.0, 2.0)] * 2)
