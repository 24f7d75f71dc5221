"""The serving study end to end on a tiny config, and its config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pagedbench.bench import serving_study

TINY = {
    "settings": [{"name": "opt-13b@a100-40gb", "model": "opt-13b", "hardware": "a100-40gb", "max_seq_len": 2048}],
    "datasets": [{"name": "sharegpt", "dataset": "sharegpt", "num_requests": 80}],
    "allocators": [{"kind": "orca", "block_size": 1, "policy": "max"}, {"kind": "paged", "block_size": 16}],
    "policies": ["separate"], "policy_comparison_settings": [], "max_num_seqs": 256,
    "max_num_batched_tokens": 2560, "watermark": 0.01, "gpu_memory_utilization": 0.9, "thresholds": [2.0, 4.0],
    "low_load_requests": 20, "bisection_steps": 2, "seeds": [0],
    "memory_points": [{"dataset": "sharegpt", "rate": 2.0}],
    "workers": 1,
}


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_study_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_SERVING_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    serving_study.main(["--config", str(write(tmp_path, TINY)), "--out", str(out)])
    doc = json.loads((out / "serving.json").read_text())
    assert doc["environment"]["git"]["commit"] and doc["schema_version"] >= 2
    caps = {s["allocator"]: s["capacity"]["2.0"] for s in doc["searches"]}
    assert caps["paged bs=16"] > caps["Orca (Max)"] > 0  # paging buys request rate at equal latency
    for s in doc["searches"]:
        lats = [p["normalized_latency_s"] for p in sorted(s["points"], key=lambda p: p["rate"])]
        assert lats[-1] > 2.0 * s["low_load_normalized_latency_s"]  # the bracket reached saturation
        assert "2.0" not in s["lower_bound_only"]
    (mem,) = [m for m in doc["memory"] if m["allocator"] == "paged bs=16"]
    assert sum(mem["shares"].values()) - mem["shares"]["rounding_waste"] == pytest.approx(1.0)
    text = (out / "serving.md").read_text()
    assert "| opt-13b@a100-40gb" in text and "2.7–8×" in text and "KV slots" in text
    assert (out / "serving_latency.png").stat().st_size > 0
    cached = len(list((tmp_path / "cache").iterdir()))
    serving_study.main(["--config", str(write(tmp_path, TINY)), "--out", str(out), "--no-plots"])
    assert len(list((tmp_path / "cache").iterdir())) == cached  # the re-run resumed from the cache
    assert json.loads((out / "serving.json").read_text())["searches"] == doc["searches"]


@pytest.mark.parametrize(("change", "message"), [
    ({"colour": 1}, "unknown keys \\['colour'\\]"),
    ({"thresholds": [1.0]}, "thresholds must be > 1"),
    ({"datasets": [{"name": "x", "dataset": "nope", "num_requests": 3}]}, "dataset 'x'"),
])
def test_config_errors_name_the_file_and_key(tmp_path, change, message):
    path = write(tmp_path, {**TINY, **change})
    with pytest.raises(ValueError, match=message) as e:
        serving_study.load_config(path)
    assert str(path) in str(e.value)


def test_missing_key(tmp_path):
    doc = dict(TINY)
    del doc["seeds"]
    with pytest.raises(ValueError, match="missing key 'seeds'"):
        serving_study.load_config(write(tmp_path, doc))
