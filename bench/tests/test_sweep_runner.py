"""The sweep runner: a small sweep gives the same results in this process, on a process pool and on Ray; so
does a small serving study, whose sweeps run through it."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import yaml
from pagedbench.bench.common import sweep_runner
from pagedbench.bench.studies.serve_sim import study as serve_sim
from pagedbench.bench.studies.serving import study as serving_study
from pagedbench.bench.studies.serving.config import load_config
from pagedbench.bench.tests.test_serving_study import TINY

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


def _study_config(tmp_path):
    """The serving study's tiny config, one seed, on two local processes."""
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump({**TINY, "seeds": [0], "sensitivity": None, "workers": 2}))
    return load_config(path)


def _results(doc: dict) -> tuple:
    """A study's searches and memory points without the time each point took to simulate."""
    def strip(row: dict) -> dict:
        return {k: v for k, v in row.items() if k != "wall_s"}
    return ([{**s, "points": [strip(p) for p in s["points"]]} for s in doc["searches"]],
            [strip(m) for m in doc["memory"]])


def test_ray_sweep_equals_the_process_pool(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    points = _points(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("PAGEDBENCH_SERVE_SIM_CACHE", str(tmp_path / "pool"))
    pooled = sweep_runner.map_points(serve_sim.run_trace_point, points, workers=2, use_ray=False)
    monkeypatch.setenv("PAGEDBENCH_SERVING_CACHE", str(tmp_path / "study_pool"))
    study = _study_config(tmp_path)
    pooled_study = serving_study.run_study(study, progress=False)
    # a local instance only (never an outside cluster), its files under the test's folder: through a short
    # link, as a socket's path must fit in 107 bytes; no token written to the home folder
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    (tmp_path / "ray").mkdir()
    link = Path(tempfile.mkdtemp(prefix="pb")) / "r"
    link.symlink_to(tmp_path / "ray")
    ray.init(num_cpus=2, _temp_dir=str(link), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PAGEDBENCH_SERVE_SIM_CACHE": str(tmp_path / "ray_cache"),
                                       "PAGEDBENCH_SERVING_CACHE": str(tmp_path / "study_ray")}})
    try:
        on_ray = sweep_runner.map_points(serve_sim.run_trace_point, points)  # a started instance is used
        study_on_ray = serving_study.run_study(study, progress=False)
    finally:
        ray.shutdown()
        link.unlink()
        link.parent.rmdir()
    assert on_ray == pooled
    assert len(list((tmp_path / "ray_cache").iterdir())) == len(points)  # computed there, not read from here
    assert _results(study_on_ray) == _results(pooled_study)
    assert len(list((tmp_path / "study_ray").iterdir())) == len(list((tmp_path / "study_pool").iterdir())) > 0
