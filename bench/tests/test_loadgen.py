"""The load generator against the real server (tiny model, 127.0.0.1): a shipped trace replayed in real
time gives every request its trace's output length, the serving study's summary keys, and offered vs
achieved rates; refused requests are counted apart and kept out of the latencies."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from pagedbench.bench import loadgen
from pagedbench.bench.workloads import Request, arrivals, trace_formats
from pagedbench.refengine import LLM
from pagedbench.refengine.cli import resolve_model
from pagedbench.refengine.server.launch import start_in_thread


@pytest.fixture(scope="module")
def url():
    running = start_in_thread(LLM(resolve_model("tiny"), max_model_len=256, seed=0), model_name="tiny")
    try:
        yield running.url
    finally:
        running.stop()


def test_replays_a_shipped_trace(url, tmp_path):
    out = tmp_path / "load.json"
    argv = ["--url", url, "--trace", "azure-conv", "--requests", "6", "--max-seq-len", "96", "--over-context",
            "clip", "--vocab-size", "512", "--time-scale", "0.05", "--model", "tiny", "--out", str(out)]
    assert loadgen.main(argv) == 0
    doc = json.loads(out.read_text())
    trace = trace_formats.load_trace(trace_formats.shipped("azure-conv"), max_seq_len=96,
                                     over_context="clip").requests[:6]
    recs = doc["requests"]
    assert [len(r["token_times_s"]) for r in recs] == [r.output_len for r in trace]  # ignore_eos held them
    assert all(r["error"] is None and r["sent_s"] >= r["scheduled_s"] for r in recs)
    s = doc["summary"]
    assert (s["completed"], s["failed"], s["num_requests"]) == (6, 0, 6)
    assert s["total_output_tokens"] == sum(r.output_len for r in trace)
    assert s["offered_request_rate"] == pytest.approx(arrivals.mean_rate(arrivals.replay(trace, 0.05)))
    assert s["achieved_request_rate"] == pytest.approx(6 / s["duration"])
    assert 0 < s["median_ttft_ms"] <= s["median_e2el_ms"] and s["mean_tpot_ms"] > 0 and s["p99_itl_ms"] >= 0
    assert not [k for k in s if "queue" in k]  # a client cannot see queueing
    assert all(r["sent_s"] < r["token_times_s"][0] and r["token_times_s"] == sorted(r["token_times_s"])
               for r in recs)


def test_refused_requests_are_failures_not_latencies(url):
    reqs = (Request(0, 4, 5, 0.0), Request(1, 300, 5, 0.01), Request(2, 3, 4, 0.02))  # 300 > max_model_len 256
    result = asyncio.run(loadgen.run_load(url, reqs, vocab_size=512))
    s = result.summary()
    assert (s["completed"], s["failed"]) == (2, 1)
    assert [r.request_id for r in result.failed] == [1] and "HTTP 400" in result.failed[0].error
    assert "maximum context length is 256 tokens" in result.failed[0].error
    assert s["total_output_tokens"] == 9 and s["total_input_tokens"] == 7


def test_an_unreachable_server_fails_every_request():
    result = asyncio.run(loadgen.run_load("http://127.0.0.1:9", (Request(0, 2, 2, 0.0),), timeout_s=2.0))
    assert result.summary()["failed"] == 1 and result.failed[0].error.startswith("ConnectError")


def in_flight_peak(records) -> int:
    """The most requests in flight at once, as the client saw them (sent to last token)."""
    spans = [(r.sent_s, r.token_times_s[-1]) for r in records]
    return max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)


@pytest.mark.parametrize("cap", [1, 3])
def test_a_closed_loop_keeps_exactly_its_concurrency_in_flight(url, cap):
    reqs = loadgen.schedule([Request(i, 4 + i, 12, 0.0) for i in range(8)], pattern="none", rate=None,
                            time_scale=1.0, burstiness=1.0, seed=0)
    result = asyncio.run(loadgen.run_load(url, reqs, vocab_size=512, max_concurrency=cap))
    assert result.summary()["completed"] == 8
    assert in_flight_peak(result.records) == cap  # never more, and a closed loop fills every slot
    by_send = sorted(result.records, key=lambda r: r.sent_s)
    # the (cap+1)-th request waits for a slot: it is sent only once one of the first cap has ended
    assert by_send[cap].sent_s >= min(r.token_times_s[-1] for r in by_send[:cap])


def test_without_a_bound_every_request_is_in_flight_at_once(url):
    reqs = loadgen.schedule([Request(i, 4 + i, 12, 0.0) for i in range(6)], pattern="none", rate=None,
                            time_scale=1.0, burstiness=1.0, seed=0)
    result = asyncio.run(loadgen.run_load(url, reqs, vocab_size=512))
    assert in_flight_peak(result.records) == 6


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_a_bad_concurrency_is_refused(url, bad):
    with pytest.raises(ValueError, match="max_concurrency must be None or an int >= 1"):
        asyncio.run(loadgen.run_load(url, (Request(0, 2, 2, 0.0),), max_concurrency=bad))


def test_a_concurrency_sweep_runs_once_per_value_and_records_each(url, tmp_path):
    out = tmp_path / "sweep.json"
    argv = ["--url", url, "--trace", "azure-conv", "--requests", "6", "--max-seq-len", "64", "--over-context",
            "clip", "--vocab-size", "512", "--arrivals", "none", "--max-concurrency", "1,3", "--out", str(out)]
    assert loadgen.main(argv) == 0
    doc = json.loads(out.read_text())
    assert [run["summary"]["max_concurrency"] for run in doc["sweep"]] == [1, 3]
    for run, cap in zip(doc["sweep"], (1, 3)):
        recs = [loadgen.RequestRecord(**{**r, "token_times_s": tuple(r["token_times_s"])}) for r in run["requests"]]
        assert run["summary"]["completed"] == 6 and in_flight_peak(recs) == cap


def test_a_duration_stops_sending_and_leaves_the_rest_out(url):
    reqs = loadgen.schedule([Request(i, 4, 30, 0.0) for i in range(40)], pattern="none", rate=None,
                            time_scale=1.0, burstiness=1.0, seed=0)
    result = asyncio.run(loadgen.run_load(url, reqs, vocab_size=512, max_concurrency=1, duration_s=0.3))
    s = result.summary()
    assert 0 < s["num_requests"] < 40 and s["failed"] == 0  # not sent is not failed
    assert max(r.sent_s for r in result.records) <= 0.3 + 0.05
    with pytest.raises(ValueError, match="duration_s must be None or a number > 0"):
        asyncio.run(loadgen.run_load(url, reqs[:1], duration_s=0))
