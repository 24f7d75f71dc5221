"""serve-sim on small files of every supported format, its --help, and bad input leaving nothing behind."""

from __future__ import annotations

import json

import pytest
from pagedbench.bench.studies.serve_sim import study as serve_sim
from pagedbench.bench.workloads import trace_formats

FILES = {
    "azure.csv": "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{i:02d}.5000000,{100 + 37 * i},{20 + 11 * i}\n" for i in range(12)),
    "burstgpt.csv": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
        f"{2 * i},ChatGPT,{80 + 29 * i},{15 + 7 * i},0,Conversation log\n" for i in range(12)),
    "vidur.csv": "arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{0.7 * i},{90 + 41 * i},{25 + 5 * i}\n" for i in range(12)),
    "mooncake.jsonl": "".join(json.dumps({"timestamp": 900 * i, "input_length": 300 + 100 * i, "output_length": 30,
                                          "hash_ids": [0, *range(10 * i + 1, 10 * i + 1 + (299 + 100 * i) // 512)]})
                              + "\n" for i in range(12)),
    "project.jsonl": "".join(json.dumps({"prompt_len": 50 + 20 * i, "output_len": 40, "arrival_s": 0.5 * i}) + "\n"
                             for i in range(12)),
}


def _args(trace, out, *extra):
    return ["--trace", str(trace), "--model", "llama-3.1-8b", "--gpu", "a100-40gb", "--managers", "paged",
            "orca-max", "--scales", "1", "0.01", "--workers", "1", "--out", str(out), "--no-plots", *extra]


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_format_runs_end_to_end(name, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_SERVE_SIM_CACHE", str(tmp_path / "cache"))
    trace = tmp_path / name
    trace.write_text(FILES[name])
    serve_sim.main(_args(trace, tmp_path / "out", "--prefix-caching"))
    doc = json.loads((tmp_path / "out" / "serve_sim.json").read_text())
    assert doc["trace"]["format"] == trace_formats.sniff_format(trace) and doc["trace"]["num_requests"] == 12
    for manager in ("paged", "orca-max"):
        rows = doc["results"][manager]
        assert [r["time_scale"] for r in rows] == [1.0, 0.01]
        assert all(r["num_finished"] == 12 for r in rows)
        assert rows[1]["rate_rps"] == pytest.approx(100 * rows[0]["rate_rps"])
        # compressing the trace a hundredfold can only queue requests: latency and pool use do not drop
        assert rows[1]["mean_normalized_latency_s"] >= rows[0]["mean_normalized_latency_s"]
        assert rows[1]["peak_pool_use"] >= rows[0]["peak_pool_use"] > 0
    assert (tmp_path / "out" / "serve_sim.md").read_text().startswith("# serve-sim")


def test_over_context_policy_is_counted_in_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_SERVE_SIM_CACHE", str(tmp_path / "cache"))
    trace = tmp_path / "v.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,100,20\n1,5000,20\n2,200,30\n")
    with pytest.raises(SystemExit, match=r"v\.csv: request 1 has 5000 \+ 20 = 5020 tokens, more than max_seq_len 4096"):
        serve_sim.main(_args(trace, tmp_path / "out", "--max-seq-len", "4096"))
    assert not (tmp_path / "out").exists()  # nothing written
    serve_sim.main(_args(trace, tmp_path / "out", "--over-context", "drop", "--max-seq-len", "4096"))
    doc = json.loads((tmp_path / "out" / "serve_sim.json").read_text())
    assert (doc["trace"]["num_dropped"], doc["trace"]["num_requests"]) == (1, 2)
    assert "1 dropped" in (tmp_path / "out" / "serve_sim.md").read_text()


def test_bad_trace_names_line_and_field_and_writes_nothing(tmp_path):
    trace = tmp_path / "v.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,100,20\n1,x,20\n")
    with pytest.raises(SystemExit, match=r"v\.csv:3: field 'num_prefill_tokens' must be a number, got 'x'"):
        serve_sim.main(_args(trace, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_help_lists_shipped_traces_gpus_models_and_slo_presets(capsys):
    with pytest.raises(SystemExit):
        serve_sim.main(["--help"])
    text = capsys.readouterr().out
    for word in [*trace_formats.SHIPPED, "h100-sxm", "a100-40gb", "llama-3.1-8b", *serve_sim.SLO_PRESETS]:
        assert word in text


def test_shipped_trace_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_SERVE_SIM_CACHE", str(tmp_path / "cache"))
    serve_sim.main(_args("mooncake-conv", tmp_path / "out", "--requests", "20", "--max-seq-len", "32768",
                         "--over-context", "drop", "--prefix-caching", "--gpu", "h200"))
    doc = json.loads((tmp_path / "out" / "serve_sim.json").read_text())
    assert doc["trace"]["format"] == "mooncake" and doc["trace"]["num_requests"] == 20
    with pytest.raises(SystemExit, match="the 6 requests served all arrive at once: no rate to sweep"):
        serve_sim.main(_args("mooncake-conv", tmp_path / "out2", "--requests", "6", "--over-context", "clip"))


def test_capacity_is_the_highest_rate_below_the_first_failure():
    from pagedbench.bench.studies.serve_sim.report import capacity

    rows = [{"rate_rps": r, "meets_slo": ok} for r, ok in [(1, True), (2, True), (4, False), (8, True)]]
    assert capacity(rows) == 2  # a noisy pass above a failure does not count
    assert capacity([{"rate_rps": 1, "meets_slo": False}]) == 0.0


def test_goodput_counts_requests_meeting_the_slo():
    from pagedbench.bench.sim.simulator import Shares, SimResult
    from pagedbench.bench.studies.serve_sim.report import metrics
    from pagedbench.bench.workloads import Request

    trace = (Request(1, 5, 10, 1.0), Request(0, 5, 2, 0.0))  # served in arrival order: request 0 first
    result = SimResult("paged", 64, 10, 10, Shares(0, 0, 0, 0, 0, 1), 1.0, 2, 0, 2, 0.75, simulated_s=4.0,
                       latencies_s=(2.0, 5.0))  # request 0: 2 s / 2 tokens = 1.0; request 1: 5 s / 10 = 0.5
    row = metrics(trace, result, 1.0)
    assert row["goodput_rps"] == 0.5 and row["meets_slo"] is True
    assert metrics(trace, result, 0.7)["goodput_rps"] == 0.25 and not metrics(trace, result, 0.7)["meets_slo"]
    assert row["output_tokens_per_s"] == 3.0


def test_the_context_defaults_to_the_models(tmp_path, monkeypatch):
    # a 5,020-token request fits Llama-3.1-8B's 131,072 context: served without --max-seq-len
    monkeypatch.setenv("PAGEDBENCH_SERVE_SIM_CACHE", str(tmp_path / "cache"))
    trace = tmp_path / "v.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,100,20\n1,5000,20\n2,200,30\n")
    serve_sim.main(_args(trace, tmp_path / "out"))
    doc = json.loads((tmp_path / "out" / "serve_sim.json").read_text())
    assert doc["trace"]["max_seq_len"] == 131072 and doc["trace"]["num_requests"] == 3
    with pytest.raises(SystemExit, match=r"--max-seq-len must be in \[1, 131072\] \(llama-3.1-8b's context\), "
                                         "got 200000"):
        serve_sim.main(_args(trace, tmp_path / "out2", "--max-seq-len", "200000"))
