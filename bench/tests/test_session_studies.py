"""The Fig. 16, 17 and 19 and multi-turn studies end to end on tiny configs: they run, their records hold
what their reports read, and their reports render."""

from __future__ import annotations

import dataclasses
import math

import pytest
from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.studies.chatbot import report as chatbot_report
from pagedbench.bench.studies.chatbot import study as chatbot
from pagedbench.bench.studies.fig19 import report as fig19_report
from pagedbench.bench.studies.fig19 import study as fig19
from pagedbench.bench.studies.multi_turn import report as multi_turn_report
from pagedbench.bench.studies.multi_turn import study as multi_turn
from pagedbench.bench.studies.shared_prefix import report as shared_prefix_report
from pagedbench.bench.studies.shared_prefix import study as shared_prefix


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_SERVING_CACHE", str(tmp_path / "cache"))


def _doc(run: dict) -> dict:
    return {"environment": env_mod.environment(), "wall_s": 0.0, **run}


def test_fig19_swap_costs_more_than_recompute_for_small_blocks_only():
    cfg = dataclasses.replace(fig19.QUICK, sim_block_sizes=(16,), rates=(2.5,), span_s=30.0, cpu_block_sizes=(1, 16),
                              cpu_sequence_tokens=64, cpu_repeats=1)
    doc = _doc(fig19.run_study(cfg, progress=False))
    by_bs = {r["block_size"]: r for r in doc["cost_model"]}
    assert by_bs[1]["swap_block_s"] > by_bs[1]["recompute_block_s"]  # latency-bound tiny copies
    assert by_bs[64]["swap_block_s"] < by_bs[64]["recompute_block_s"]
    assert len({r["sequence_recompute_s"] for r in doc["cost_model"]}) == 1  # recompute uses no block
    swap = [p for p in doc["simulated"] if p["mode"] == "swap"]
    assert swap and all(p["num_finished"] == p["num_requests"] for p in doc["simulated"])
    (paired,) = doc["paired"]
    assert paired["recompute_over_swap"]["num_seeds"] == len(cfg.seeds) > 1
    assert "Fig. 19" in fig19_report.markdown(doc) and "95% interval lies below 1" in fig19_report.markdown(doc)


def test_fig19_pairs_the_two_modes_by_seed():
    """The ratio is over the seeds with both latencies (the same arrivals); each mode's mean over all its own."""
    points = [{"block_size": 16, "rate": 2.0, "seed": seed, "mode": mode, "normalized_latency_s": v}
              for seed, mode, v in [(0, "recompute", 0.9), (0, "swap", 1.0), (1, "recompute", 2.2), (1, "swap", 2.0),
                                    (2, "recompute", 5.0), (3, "swap", None)]]
    (row,) = fig19.paired_rows(points)
    ratio = row["recompute_over_swap"]
    assert ratio["num_seeds"] == 2 and ratio["mean"] == pytest.approx(math.sqrt(0.9 * 1.1))
    assert ratio["low"] < ratio["mean"] < ratio["high"]
    assert row["recompute_s"]["num_seeds"] == 3 and row["recompute_s"]["mean"] == pytest.approx(8.1 / 3)
    assert row["swap_s"]["num_seeds"] == 2 and row["swap_s"]["mean"] == pytest.approx(1.5)


def test_shared_prefix_and_chatbot_capacities_are_paired_and_rendered():
    cfg = dataclasses.replace(shared_prefix.QUICK, workloads=("fewshot-5",), span_s=10.0, bisection_steps=1, workers=1)
    doc = _doc(shared_prefix.run_study(cfg, progress=False))
    assert {s["contender"] for s in doc["searches"]} == {c.label for c in shared_prefix.CONTENDERS}
    cached = next(r for r in doc["ratios"] if r["ours"] == shared_prefix.CACHED and r["versus"] == shared_prefix.ORCA)
    assert cached["paper"] == 3.58
    assert "3.58x" in shared_prefix_report.markdown(doc)
    cfg = dataclasses.replace(chatbot.QUICK, seeds=(0,), span_s=20.0, bisection_steps=1, workers=1)
    doc = _doc(chatbot.run_study(cfg, progress=False))
    assert len(doc["ratios"]) == 3 and "2.0x" in chatbot_report.markdown(doc)


def test_multi_turn_hits_the_history_when_it_fits_and_less_when_it_does_not():
    cfg = dataclasses.replace(multi_turn.QUICK, num_clients=16, num_rounds=3, budget_shares=(1.25, 0.1), seeds=(0,))
    doc = _doc(multi_turn.run_study(cfg, progress=False))
    runs = {(run["tier"], run["budget_share"]): run for run in doc["runs"]}
    assert set(runs) == {(t, b) for t in ("device", "host") for b in (1.25, 0.1)}
    fits, tight = runs["device", 1.25], runs["device", 0.1]
    assert fits["rounds"][0]["hit_rate"] == 0.0
    # round 1 repeats 512 + 64 tokens of 1088, all but the unstored last token's block cached
    assert fits["rounds"][1]["hit_rate"] == pytest.approx((575 // 16 * 16) / 1088)
    assert sum(r["hit_tokens"] for r in tight["rounds"]) < sum(r["hit_tokens"] for r in fits["rounds"])
    with pytest.raises(ValueError, match="unknown tiers"):
        dataclasses.replace(cfg, tiers=("nvme",))


def test_multi_turn_host_tier_loads_back_what_the_device_evicts():
    cfg = dataclasses.replace(multi_turn.QUICK, num_clients=16, num_rounds=3, budget_shares=(1.25, 0.1), seeds=(0,))
    doc = _doc(multi_turn.run_study(cfg, progress=False))
    runs = {(run["tier"], run["budget_share"]): run for run in doc["runs"]}
    device, host = runs["device", 0.1], runs["host", 0.1]
    assert host["host_blocks"] == -(-int(1.25 * host["history_tokens"]) // 16) and device["host_blocks"] == 0
    for run in doc["runs"]:
        for r in run["rounds"]:
            assert r["device_hit_rate"] + r["host_hit_rate"] + r["computed_share"] == pytest.approx(1.0)
        assert run["prefix_host_hit_tokens"] == 0 or run["tier"] == "host"
    # the tier holds every history: the later rounds hit as much as with a device that holds them all
    assert [r["hit_tokens"] for r in host["rounds"]] == [r["hit_tokens"] for r in runs["device", 1.25]["rounds"]]
    assert sum(r["host_hit_tokens"] for r in host["rounds"]) > 0
    assert all(r["computed_share"] <= d["computed_share"] for r, d in zip(host["rounds"], device["rounds"]))
    assert host["num_offload_loaded_blocks"] > 0 and host["copy_s"] > 0
    # where the device holds every history the tier changes no hit (its stores may still cost time)
    assert [r["hit_tokens"] for r in runs["host", 1.25]["rounds"]] == \
        [r["hit_tokens"] for r in runs["device", 1.25]["rounds"]]
    text = multi_turn_report.markdown(doc)
    assert "host hit rate" in text and "kv_offloading_size" in text
    # only what the sources say in text is cited; the per-round figures they do not give are said to be absent
    assert "the cache hit rate jumped from 40% to 80%" in text and "up to 80% reduction in TTFT" in text
    assert "could not be found in these sources" in text
    comp = multi_turn_report.tier_comparison(doc)
    assert {(c["round"], c["tier"]) for c in comp} == {(k, t) for k in range(3) for t in ("device", "host")}
    assert all(c["budget_share"] == 0.1 for c in comp)
