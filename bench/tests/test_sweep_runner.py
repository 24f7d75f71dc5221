"""The sweep runner: a small sweep gives the same results in this process, on a process pool and on Ray."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
from pagedbench.bench import serve_sim, sweep_runner

TRACE = "arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
    f"{0.4 * i},{60 + 53 * i},{30 + 9 * i}\n" for i in range(10))


def _points(tmp_path) -> list[serve_sim.TracePoint]:
    trace = tmp_path / "v.csv"
    trace.write_text(TRACE)
    base = serve_sim.TracePoint(str(trace), "sha", "vidur", "error", 2048, None, None, "paged", "llama-3.1-8b",
                                "a100-40gb", 3000, False, 0.05)
    return [dataclasses.replace(base, time_scale=s, manager=m) for m in ("paged", "orca-pow2") for s in (1.0, 0.05)]


def test_process_pool_equals_one_process(tmp_path, monkeypatch):
    points = _points(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PAGEDBENCH_SERVE_SIM_CACHE", str(tmp_path / "one"))
    here = sweep_runner.map_points(serve_sim.run_trace_point, points, workers=1, use_ray=False)
    monkeypatch.setenv("PAGEDBENCH_SERVE_SIM_CACHE", str(tmp_path / "pool"))
    pooled = sweep_runner.map_points(serve_sim.run_trace_point, points, workers=2, use_ray=False)
    assert pooled == here and len({r["mean_normalized_latency_s"] for r in here}) > 1
    assert len(list((tmp_path / "pool").iterdir())) == len(points)  # each point cached by its hash
    with pytest.raises(ValueError, match="workers must be an int >= 1, got 0"):
        sweep_runner.map_points(serve_sim.run_trace_point, points, workers=0)


def test_ray_address_comes_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert sweep_runner.ray_address() == "head:6379" and sweep_runner.ray_address("other:1") == "other:1"
    monkeypatch.delenv("RAY_ADDRESS")
    assert sweep_runner.ray_address() is None


def test_ray_sweep_equals_the_process_pool(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    points = _points(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PAGEDBENCH_SERVE_SIM_CACHE", str(tmp_path / "pool"))
    pooled = sweep_runner.map_points(serve_sim.run_trace_point, points, workers=2, use_ray=False)
    # a local instance only (never an outside cluster), its files under the test's folder: through a short
    # link, as a socket's path must fit in 107 bytes; no token written to the home folder
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    (tmp_path / "ray").mkdir()
    link = Path(tempfile.mkdtemp(prefix="pb")) / "r"
    link.symlink_to(tmp_path / "ray")
    ray.init(num_cpus=2, _temp_dir=str(link), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PAGEDBENCH_SERVE_SIM_CACHE": str(tmp_path / "ray_cache")}})
    try:
        on_ray = sweep_runner.map_points(serve_sim.run_trace_point, points)  # a started instance is used
    finally:
        ray.shutdown()
        link.unlink()
        link.parent.rmdir()
    assert on_ray == pooled
    assert len(list((tmp_path / "ray_cache").iterdir())) == len(points)  # computed there, not read from here
