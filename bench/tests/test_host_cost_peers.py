"""The side-by-side host-cost bench: peers that cannot run get a reason and no figure, figures are ratios
of best rounds, the engine's verdict, and the worker protocol end to end on our own implementation."""

from __future__ import annotations

import sys

import pytest
from pagedbench.bench.studies.host_cost import peers as host_cost_peers
from pagedbench.bench.studies.host_cost import study as host_cost
from pagedbench.bench.studies.host_cost.peers import WorkerCommand


def test_absent_peers_are_located_with_a_reason(tmp_path):
    commands = {c.name: c for c in host_cost_peers.locate(None, tmp_path / "no-venv")}
    assert commands["pagedbench"].python == sys.executable
    assert commands["nano-vllm"].python is None and "--nano-vllm" in commands["nano-vllm"].reason
    assert commands["vllm-v1"].python is None and "make peers" in commands["vllm-v1"].reason
    not_a_checkout = host_cost_peers.locate(str(tmp_path), tmp_path / "no-venv")[1]
    assert not_a_checkout.python is None and "not a nano-vllm checkout" in not_a_checkout.reason


def test_summary_is_best_round_per_sequence_step_and_ratio_to_ours():
    results = {"pagedbench": {"status": "ok", "seconds": {"kv": [2.0, 1.0], "engine": [5.0]}},
               "nano-vllm": {"status": "ok", "seconds": {"kv": [4.0, 3.0]}},
               "vllm-v1": {"status": "not installed", "reason": "no peers venv"}}
    s = host_cost_peers.summarise(results, 1_000_000)
    assert s["pagedbench"]["figures"]["kv"]["us_per_seq_step"] == pytest.approx(1.0)
    assert s["nano-vllm"]["figures"]["kv"]["us_per_seq_step"] == pytest.approx(3.0)
    assert s["nano-vllm"]["figures"]["kv"]["ratio_to_ours"] == pytest.approx(3.0)
    assert s["vllm-v1"] == {"status": "not installed", "reason": "no peers venv"}
    text = "\n".join(host_cost_peers.markdown(s, host_cost_peers.engine_verdict(5.0, 1.0, 5.0), "trace", 2))
    assert "| nano-vllm | 3.00 (3.00x) | not driven |" in text
    assert "- vllm-v1: not installed (no peers venv)" in text and "| vllm-v1 |" not in text
    assert "**5.00x**" in text and "**met**" in text
    assert "padded layout" not in text  # not measured: not reported


def test_the_cpu_layouts_cost_is_reported_beside_the_shared_step():
    results = {"pagedbench": {"status": "ok", "seconds": {"engine": [5.0], "engine_cpu_layout": [20.0]}}}
    s = host_cost_peers.summarise(results, 1_000_000)
    text = "\n".join(host_cost_peers.markdown(s, host_cost_peers.engine_verdict(5.0, 1.0, 5.0), "trace", 1))
    assert "20.00 µs per sequence with it, 4.0x the step without it" in text


def test_engine_verdict_against_append_token():
    assert host_cost_peers.engine_verdict(10.0, 2.0, 5.0)["verdict"] == "met"
    v = host_cost_peers.engine_verdict(10.1, 2.0, 5.0)
    assert v["verdict"] == "not met" and v["ratio"] == pytest.approx(5.05)
    assert host_cost_peers.engine_verdict(None, 2.0, 5.0)["verdict"] == "not measured"


def _tiny_trace() -> dict:
    prompts = [[(7 * i + j) % 500 for j in range(5 + 11 * i)] for i in range(6)]
    decode = [[(3 * s + i) % 500 for i in range(6)] for s in range(4)]
    return {"prompts": prompts, "decode_tokens": decode, "block_size": 4, "num_blocks": 64,
            "prefix_caching": True, "nano_vllm_path": None}


def test_workers_run_interleaved_rounds_and_a_missing_peer_is_not_installed():
    commands = [WorkerCommand("pagedbench", sys.executable),
                WorkerCommand("nano-vllm", sys.executable),  # no checkout in the trace
                WorkerCommand("vllm-v1", None, "no peers venv")]
    results = host_cost_peers.run_side_by_side(commands, _tiny_trace(), rounds=2)
    ours = results["pagedbench"]
    assert ours["status"] == "ok"
    assert set(ours["seconds"]) == {"kv", "append", "scheduler", "engine", "engine_cpu_layout"}
    assert all(len(v) == 2 and min(v) > 0 for v in ours["seconds"].values())
    assert results["nano-vllm"]["status"] == "not installed" and "--nano-vllm" in results["nano-vllm"]["reason"]
    assert results["vllm-v1"] == {"status": "not installed", "reason": "no peers venv"}


def test_the_peer_variant_must_be_a_variant():
    cfg = host_cost.load_config()
    assert host_cost.peer_trace(cfg, None)["prefix_caching"] is True
    bad = host_cost.HostCostConfig(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "peer_variant": "nope"})
    with pytest.raises(ValueError, match="peer_variant 'nope'"):
        host_cost.peer_trace(bad, None)


def test_engine_verdict_takes_the_median_of_each_rounds_ratio():
    # the best rounds (4.0 and 1.0) came at different moments: their ratio, 4x, is not what any round saw
    v = host_cost_peers.engine_verdict(4.0, 1.0, 5.0, per_round=([4.0, 12.0, 12.0], [2.0, 2.0, 1.0]))
    assert v["ratio"] == 6.0 and v["verdict"] == "not met"


def test_vllm_v1_block_manager_runs_in_the_peers_venv():
    """The installed vLLM's KVCacheManager is driven as the worker drives it (skipped without ``make peers``)."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    python = root / ".peers" / "bin" / "python"
    if not python.exists():
        pytest.skip("no peers venv (make peers)")
    trace = {"prompts": [[1, 2, 3, 4] * 5, [1, 2, 3, 4] * 5], "decode_tokens": [[7, 8]] * 4, "block_size": 16,
             "num_blocks": 32, "prefix_caching": True, "nano_vllm_path": None}
    run = subprocess.run([str(python), str(root / "bench" / "studies" / "host_cost" / "peer_worker.py"), "vllm-v1"],
                         input=json.dumps(trace) + "\nround\nquit\n", capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    answers = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert answers and answers[0] == {"ready": True, "measurements": ["kv"]}, run.stdout + run.stderr[-2000:]
    assert answers[1]["seconds"]["kv"] > 0
