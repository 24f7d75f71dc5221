"""The Fig. 14 study: paired ratios from capacities, a micro run of the harness end to end (its report
and plot), and one-sample points keeping their cache keys."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from pagedbench.bench.sim.points import SIM_VERSION, cost_model
from pagedbench.bench.sim.simulator import AllocatorSpec
from pagedbench.bench.studies.beam import serving as beam_serving
from pagedbench.bench.studies.beam import serving_report as beam_serving_report


def _search(group: str, allocator: str, seed: int, cap: float | None, failing: float | None) -> dict:
    return {"group": group, "allocator": allocator, "seed": seed, "capacity": {"2.0": cap},
            "capacity_bracket": {"2.0": None if cap is None else [cap, failing]}}


def test_ratios_pair_seeds_and_carry_the_papers_number_against_oracle_only():
    searches = [_search("beam=6", "paged bs=16", 0, 10.0, 11.0), _search("beam=6", "paged bs=16", 1, 12.0, 13.0),
                _search("beam=6", "Orca (Oracle)", 0, 5.0, 6.0), _search("beam=6", "Orca (Oracle)", 1, 6.0, 7.0),
                _search("beam=6", "Orca (Max)", 0, 1.0, 2.0), _search("beam=6", "Orca (Max)", 1, None, None)]
    rows = {r["versus"]: r for r in beam_serving.ratios(searches, "2.0", ["beam=6"])}
    oracle = rows["Orca (Oracle)"]
    assert oracle["ratio"]["mean"] == pytest.approx(2.0) and oracle["ratio"]["num_seeds"] == 2
    assert oracle["ratio"]["low"] <= (10 / 6 + 12 / 7) / 2 and oracle["ratio"]["high"] >= (11 / 5 + 13 / 6) / 2
    assert oracle["paper"] == 2.3
    assert rows["Orca (Max)"]["ratio"] is None and rows["Orca (Max)"]["paper"] is None  # a seed without capacity


MICRO = dataclasses.replace(
    beam_serving.QUICK, groups=(("beam", 2),), seeds=(0,), span_s=10.0, low_load_requests=8, bisection_steps=0,
    allocators=(AllocatorSpec("orca", 1, "oracle"), AllocatorSpec("paged", 16)), workers=1, max_seq_len=512)


def test_micro_study_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_SERVING_CACHE", str(tmp_path / "cache"))
    trajectories = {2: (((0, 0), (0, 1), (0, 0), (1, 1)),)}
    doc = beam_serving.run_study(MICRO, trajectories, progress=False)
    caps = {s["allocator"]: s["capacity"]["2.0"] for s in doc["searches"]}
    assert set(caps) == {"Orca (Oracle)", "paged bs=16"} and all(s["group"] == "beam=2" for s in doc["searches"])
    assert caps["paged bs=16"] >= caps["Orca (Oracle)"] > 0
    (ratio,) = doc["ratios"]
    assert ratio["ratio"]["mean"] == pytest.approx(caps["paged bs=16"] / caps["Orca (Oracle)"])
    doc["environment"] = {}
    monkeypatch.setattr(beam_serving_report, "environment_markdown", lambda env: "")
    text = beam_serving_report.markdown(json.loads(json.dumps(doc)))
    row = next(line for line in text.splitlines() if line.startswith("| beam=2  | Orca (Oracle) |"))
    assert f"{ratio['ratio']['mean']:.2f}x" in row and row.split("|")[4].strip() == "–"  # no paper number for 2
    beam_serving_report.plot(doc, tmp_path)
    assert (tmp_path / beam_serving_report.PLOT).stat().st_size > 0


def test_a_one_sample_point_keeps_its_cache_key():
    setting = dataclasses.replace(MICRO, linear_model="roofline").setting  # the key before the tile model
    low = beam_serving.Point(setting, beam_serving.Dataset("alpaca", "alpaca"), AllocatorSpec("paged", 16),
                             "separate", 1.0, 0, 512, 1000, False, beam_serving._method(MICRO))
    cost = cost_model(setting)
    fields = {f.name: getattr(low, f.name) for f in dataclasses.fields(low) if f.name != "group"}
    before = json.loads(json.dumps(fields, default=_asdict))
    # fields added later keep a default run's old key: a roofline setting, a dataset without a workload
    del before["setting"]["linear_model"]
    del before["dataset"]["workload"]
    old = json.dumps([SIM_VERSION, before, dataclasses.asdict(cost)], sort_keys=True)
    assert low.key(cost) == hashlib.sha256(old.encode()).hexdigest()[:24]
    group = beam_serving.GroupSpec("parallel", 2)
    assert dataclasses.replace(low, group=group).key(cost) != low.key(cost)


def _asdict(obj):
    return dataclasses.asdict(obj)
