"""A real trace as the serving study's arrival stream: replayed at the point's rate, from a seed-drawn start,
wrapping around; and a study point served from it (Mooncake's shared blocks reach the prefix cache)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from pagedbench.bench.sim import points as serving_points
from pagedbench.bench.sim.settings import Dataset, Setting
from pagedbench.bench.sim.simulator import AllocatorSpec
from pagedbench.bench.workloads import Request, trace_spans


def trace(gaps: list[float]) -> tuple[Request, ...]:
    t, out = 0.0, []
    for i, g in enumerate([0.0, *gaps]):
        t += g
        out.append(Request(i, 10 + i, 5 + i, t))
    return tuple(out)


def test_the_replay_keeps_the_pattern_scaled_to_the_rate_from_the_seeds_start():
    reqs = trace([1.0, 3.0, 1.0, 3.0])  # 5 requests over 8 s: mean rate 0.5 req/s, gaps 1, 3, 1, 3
    got = trace_spans.span(reqs, 1.0, span_s=100.0, seed=0)  # 2x compressed: gaps 0.5, 1.5, ...
    first = [r.prompt_len for r in got[:5]]
    start = first[0] - 10
    assert first == [10 + (start + k) % 5 for k in range(5)]  # the trace's order from the drawn start
    expected = {(k, k + 1): g / 2 for k, g in enumerate([1.0, 3.0, 1.0, 3.0])}
    for a, b in itertools.pairwise(got):
        i, j, gap = a.prompt_len - 10, b.prompt_len - 10, b.arrival_s - a.arrival_s
        # inside the trace its own gap, halved; across the wrap one mean gap (8 s / 4), halved
        assert gap == pytest.approx(expected.get((i, j), 1.0)), (i, j)
    assert got[0].arrival_s == 0.0 and all(r.arrival_s < 100.0 for r in got)
    assert [r.request_id for r in got] == list(range(len(got)))
    assert len(got) / 100.0 == pytest.approx(1.0, rel=0.05)  # the offered rate
    starts = {trace_spans.span(reqs, 1.0, 10.0, seed)[0].prompt_len for seed in range(20)}
    assert len(starts) > 1  # seeds sample different stretches


def test_a_span_shorter_than_the_first_gap_still_holds_one_request():
    assert len(trace_spans.span(trace([100.0]), 0.01, span_s=1.0, seed=3)) == 1
    with pytest.raises(ValueError, match="span_s must be > 0"):
        trace_spans.span(trace([1.0]), 1.0, span_s=0, seed=0)


def test_a_point_serves_mooncake_with_its_shared_prefixes(tmp_path, monkeypatch):
    """The shipped Mooncake trace at a study point: its requests, replayed, their prompt tokens sharing the
    blocks the trace's hash ids share (what the prefix cache can find); the point runs, keyed by the trace."""
    monkeypatch.setenv("PAGEDBENCH_SERVING_CACHE", str(tmp_path))
    d = Dataset("mooncake", trace="mooncake-conv", prefix_caching=True)
    method = serving_points.Method(20.0, 5, 0.1, 0.1, 3.0, 64, 2048, 0.01, ())
    p = serving_points.Point(Setting("s", "llama-3.1-8b", "h100-sxm"), d, AllocatorSpec("paged", 16), "mixed",
                             rate=0.5, seed=0, max_seq_len=16384, kv_slots=400_000, account=False, method=method)
    loaded = trace_spans.load("mooncake-conv", 16384, "drop")
    span = serving_points.span_trace(d, 0.5, 20.0, 0, 16384)
    assert {r.prompt_len for r in span} <= {r.prompt_len for r in loaded.requests}
    tokens = serving_points._prompt_tokens(d)
    by_first = {}
    for r in span:
        by_first.setdefault(r.block_hash_ids[:1], []).append(r)
    a, b = next(rs for ids, rs in by_first.items() if ids and len(rs) > 1)[:2]
    assert tokens(a)[:512] == tokens(b)[:512] and a.request_id != b.request_id
    row = serving_points.run_point(p)
    assert row["num_window_arrivals"] > 0 and not row["overloaded"]
    assert p.key(serving_points.cost_model(p.setting)) != dataclasses.replace(
        p, dataset=dataclasses.replace(d, trace="azure-conv")).key(serving_points.cost_model(p.setting))
