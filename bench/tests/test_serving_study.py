"""The serving study end to end on a tiny config, and its config errors (nothing written on a bad one)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from pagedbench.bench.studies.serving import study as serving_study
from pagedbench.bench.studies.serving.config import ServingConfigError

TINY = {
    "settings": [{"name": "opt-13b@a100-40gb", "model": "opt-13b", "hardware": "a100-40gb"}],
    "datasets": [{"name": "sharegpt", "dataset": "sharegpt"}],
    "allocators": [{"kind": "orca", "block_size": 1, "policy": "max"}, {"kind": "paged", "block_size": 16}],
    "policies": ["mixed"], "policy_comparison_settings": [], "max_num_seqs": 256,
    "max_num_batched_tokens": 512, "watermark": 0.01, "gpu_memory_utilization": 0.9, "thresholds": [2.0],
    "slos": ["mlperf-llama-3.1-8b"], "low_load_requests": 10, "bisection_steps": 1, "seeds": [0, 1],
    "span_s": 60, "warmup_frac": 0.1, "cooldown_frac": 0.1, "overload_z": 3.0,
    "memory_points": [{"dataset": "sharegpt", "rate": 2.0, "policy": "mixed"}],
    "sensitivity": {"setting": "opt-13b@a100-40gb", "dataset": "sharegpt", "policy": "mixed", "factors": [2.0],
                    "terms": ["step_overhead"]},
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
    base = [s for s in doc["searches"] if not s["cost_scale"]]
    assert len(base) == 2 * 2 and len(doc["searches"]) == 2 * 2 + 2  # 2 managers x 2 seeds, + sensitivity
    for s in doc["searches"]:
        assert s["max_seq_len"] == 2048  # the model's context
        for cap in s["capacity"].values():  # a capacity is a point that ran, passed, and was not overloaded
            if cap is not None:
                (p,) = [p for p in s["points"] if p["rate"] == cap]
                assert not p["overloaded"] and any(q["rate"] > cap for q in s["points"])  # past the knee
        assert s["saturation_rps"] >= max(p["achieved_rate"] for p in s["points"] if not p["overloaded"])
    paged = [s for s in base if s["allocator"] == "paged bs=16"]
    orca = [s for s in base if s["allocator"] == "Orca (Max)"]
    assert min(s["capacity"]["2.0"] for s in paged) > max(s["capacity"]["2.0"] for s in orca)
    point = next(p for p in paged[0]["points"] if not p["overloaded"])
    assert {"mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "p90_e2el_ms", "request_goodput"} <= set(point)
    (mem,) = [m for m in doc["memory"] if m["allocator"] == "paged bs=16"]
    assert sum(mem["shares"].values()) - mem["shares"]["rounding_waste"] == pytest.approx(1.0)
    text = (out / "serving.md").read_text()
    assert "| opt-13b@a100-40gb" in text and "2.7–8×" in text and "Overload test" in text
    assert "![opt-13b@a100-40gb](serving_opt_13b_a100_40gb.png)" in text and "step_overhead ×2" in text
    assert (out / "serving_opt_13b_a100_40gb.png").stat().st_size > 0
    cached = len(list((tmp_path / "cache").iterdir()))
    serving_study.main(["--config", str(write(tmp_path, TINY)), "--out", str(out), "--no-plots"])
    assert len(list((tmp_path / "cache").iterdir())) == cached  # the re-run resumed from the cache
    assert json.loads((out / "serving.json").read_text())["searches"] == doc["searches"]
    rendered = (out / "serving.md").read_text()
    (out / "serving.md").unlink()
    serving_study.main(["--out", str(out), "--render-only", "--no-plots"])  # from the record alone
    assert (out / "serving.md").read_text() == rendered


def setting(**kw) -> dict:
    return {**TINY, "settings": [{**TINY["settings"][0], **kw}]}


@pytest.mark.parametrize(("doc", "message"), [
    ({**TINY, "colour": 1}, r"unknown keys \['colour'\]; known: "),
    ({**TINY, "thresholds": [1.0]}, "thresholds must be > 1"),
    ({**TINY, "datasets": [{"name": "x", "dataset": "nope"}]}, "dataset 'x': unknown dataset 'nope'; known: sharegpt"),
    ({**TINY, "slos": ["mlperf-llama-9"]}, "slos: unknown SLO preset 'mlperf-llama-9'; known: mlperf-llama-3.1-8b"),
    (setting(hardware="a100-41gb"), "unknown GPU profile 'a100-41gb'; known: a100-40gb, a100-80gb"),
    (setting(model="opt-14b"), "unknown model profile 'opt-14b'; known: "),
    (setting(max_seq_len=4096), r"max_seq_len 4096 must be in \[2, 2048\] \(the context of opt-13b\)"),
    ({**TINY, "settings": [{"name": "l4", "model": "llama-3.1-8b", "hardware": "l4"}]},
     "max_seq_len 131072 exceeds the 49809 KV slots of llama-3.1-8b on l4"),
    (setting(model="opt-66b", tensor_parallel_size=5),
     "setting 'opt-13b@a100-40gb': opt-66b: 72 attention heads and 72 KV heads cannot be split over "
     "tensor_parallel_size=5"),
    (setting(hardware="l4", tensor_parallel_size=2), "setting 'opt-13b@a100-40gb': .*l4"),
    ({**TINY, "span_s": 0}, "span_s: span_s must be a positive number of seconds, got 0"),
    (setting(span_s=-60), "setting 'opt-13b@a100-40gb': span_s must be a positive number of seconds, got -60"),
    ({**TINY, "datasets": [{"name": "x"}]}, "dataset 'x': give either dataset or trace, not neither"),
    ({**TINY, "datasets": [{"name": "x", "dataset": "sharegpt", "trace": "azure-conv"}]},
     "dataset 'x': give either dataset or trace, not both"),
    ({**TINY, "datasets": [{"name": "x", "trace": "azure-chat"}]},
     "trace 'azure-chat' is neither a shipped trace \\(azure-conv, azure-code, mooncake-conv"),
    ({**TINY, "datasets": [{"name": "x", "trace": "azure-conv", "over_context": "error"}]},
     "a trace takes over_context drop or clip \\(got 'error'\\)"),
])
def test_bad_config_names_the_option_and_writes_nothing(tmp_path, doc, message):
    path = write(tmp_path, doc)
    out = tmp_path / "out"
    with pytest.raises(ServingConfigError, match=message) as e:
        serving_study.main(["--config", str(path), "--out", str(out)])
    assert str(path) in str(e.value) and not out.exists()


def test_missing_key(tmp_path):
    doc = dict(TINY)
    del doc["seeds"]
    with pytest.raises(ServingConfigError, match="missing key 'seeds'"):
        serving_study.load_config(write(tmp_path, doc))


def test_an_overloaded_point_fails_every_criterion_whatever_its_numbers():
    from pagedbench.bench.sim.serving_search import _passes

    met = {"slo": {"mlperf-llama-3.1-8b": {"met": True}}, "normalized_latency_s": 0.01}
    assert _passes({"overloaded": False, **met}, "2.0", 1.0) and _passes({"overloaded": False, **met},
                                                                         "slo:mlperf-llama-3.1-8b", 1.0)
    for criterion in ("2.0", "slo:mlperf-llama-3.1-8b"):
        assert not _passes({"overloaded": True, **met}, criterion, 1.0)
        assert not _passes({"overloaded": False}, criterion, 1.0)  # no latency measured: no pass either


def test_a_real_trace_is_a_dataset_of_the_study(tmp_path, monkeypatch):
    """A shipped trace served like a synthetic dataset: its searches, and a record of what it served (the
    requests past max_seq_len dropped and counted) in the JSON and the report."""
    monkeypatch.setenv("PAGEDBENCH_SERVING_CACHE", str(tmp_path / "cache"))
    doc = {**TINY, "datasets": [{"name": "code", "trace": "azure-code"}], "seeds": [0], "bisection_steps": 0,
           "memory_points": [], "sensitivity": None, "allocators": [TINY["allocators"][1]], "span_s": 20}
    out = tmp_path / "out"
    serving_study.main(["--config", str(write(tmp_path, doc)), "--out", str(out), "--no-plots"])
    res = json.loads((out / "serving.json").read_text())
    (t,) = res["traces"]
    assert t["dataset"] == "code" and t["trace"] == "azure-code" and t["max_seq_len"] == 2048
    assert t["num_dropped"] > 0 and t["num_served"] + t["num_dropped"] == t["num_rows"] == 8819
    (search,) = res["searches"]
    assert search["dataset"] == "code" and search["points"]
    assert "| code " in (out / "serving.md").read_text() and f"{t['num_dropped']:,} dropped" in (
        out / "serving.md").read_text()


def _precise(tmp_path, monkeypatch, **kw) -> dict:
    monkeypatch.setenv("PAGEDBENCH_SERVING_CACHE", str(tmp_path / "cache"))
    doc = {**TINY, "sensitivity": None, "memory_points": [], "capacity_resolution": 0.02, **kw}
    out = tmp_path / "out"
    serving_study.main(["--config", str(write(tmp_path, doc)), "--out", str(out), "--no-plots"])
    return json.loads((out / "serving.json").read_text()), (out / "serving.md").read_text()


def test_replicates_are_added_until_the_target_or_the_cap(tmp_path, monkeypatch):
    # an unreachable target: replicates are added (at most doubling per round) up to the cap, which is named
    doc, text = _precise(tmp_path, monkeypatch, target_half_width=1e-4, max_seeds=5)
    (group,) = doc["precision"].values()
    assert group["num_replicates"] == 5 and not group["within_target"] and group["capped"]
    assert "the replicate cap (5) was reached" in group["cap_reason"] and "the replicate cap (5)" in text
    need = int(re.search(r"would need about (\d+) replicates", group["cap_reason"]).group(1))
    assert need == math.ceil(5 * (group["widest_half_width"] / 1e-4) ** 2)
    assert sorted({s["seed"] for s in doc["searches"]}) == [0, 1, 2, 3, 4]
    for s in doc["searches"]:  # every search resolved to 2%
        assert all(r is None or r <= 0.02 for r in s["capacity_resolution"].values())
    assert "[0," not in text and "| none |" not in text


def test_later_replicates_start_near_the_earlier_ones_capacity(tmp_path, monkeypatch):
    doc, _ = _precise(tmp_path, monkeypatch, target_half_width=1e-4, max_seeds=5)
    first = [len(s["points"]) for s in doc["searches"] if s["seed"] < 2]
    later = [len(s["points"]) for s in doc["searches"] if s["seed"] >= 2]
    # the first round brackets from the low-load rate by x4; later ones from their guess by x1.21
    assert sum(later) / len(later) < sum(first) / len(first) - 2


def test_replicate_guesses_are_geometric_means_of_the_capacities_found():
    def rec(seed, caps):
        return {"setting": "s", "dataset": "d", "policy": "mixed", "cost_scale": [], "allocator": "paged bs=16",
                "seed": seed, "capacity": caps}
    guesses = serving_study.replicate_guesses([rec(0, {"2.0": 1.0, "slo:x": None}), rec(1, {"2.0": 4.0,
                                                                                      "slo:x": 3.0})])
    want = {"2.0": pytest.approx(2.0), "slo:x": pytest.approx(3.0)}
    assert guesses == {("s", "d", "mixed", "[]", "paged bs=16"): want}


def test_a_reachable_target_stops_the_replicates_short_of_the_cap(tmp_path, monkeypatch):
    doc, _ = _precise(tmp_path, monkeypatch, target_half_width=0.9, max_seeds=8)
    (group,) = doc["precision"].values()
    assert group["num_replicates"] < 8 and group["within_target"] and not group["capped"]
    assert group["widest_half_width"] <= 0.9


def test_replicates_are_added_only_for_the_precision_settings(tmp_path, monkeypatch):
    doc, _ = _precise(tmp_path, monkeypatch, target_half_width=1e-4, max_seeds=5, precision_settings=[])
    (group,) = doc["precision"].values()
    assert group["num_replicates"] == 2 and "only for precision_settings" in group["cap_reason"]


def test_a_tensor_parallel_setting_shards_its_model():
    from pagedbench.bench.costmodel import TensorParallelStepCost, kv_slot_budget, load_hardware, load_model
    from pagedbench.bench.sim.points import cost_model
    from pagedbench.bench.sim.settings import Setting

    s = Setting(name="66b", model="opt-66b", hardware="a100-40gb", tensor_parallel_size=4)
    cost = cost_model(s)
    assert isinstance(cost, TensorParallelStepCost) and cost.tensor_parallel_size == 4
    assert not isinstance(cost_model(Setting(name="13b", model="opt-13b", hardware="a100-40gb")),
                          TensorParallelStepCost)
    budget = kv_slot_budget(load_model("opt-66b"), load_hardware("a100-40gb"), 0.9, tensor_parallel_size=4)
    assert 9000 < budget.num_slots < 9700  # one GPU's share of a model that fits only across four
