"""The Fig. 2/13 decomposition: each row changes one knob alone (in its knobs and in what the simulator is
given), the two share readings on a hand-made pool, and which rows the combined run takes."""

from __future__ import annotations

import dataclasses

import pytest
from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.sim.records import StepRecord
from pagedbench.bench.studies.batch_gap import decompose, study
from pagedbench.bench.studies.batch_gap.knobs import (
    BatchGapConfigError,
    Cause,
    changed_fields,
    combined,
    default_knobs,
    knobs_for,
)
from pagedbench.bench.studies.batch_gap.runner import point_of, sim_config_of
from pagedbench.bench.studies.batch_gap.serving_point import read_serving_point
from pagedbench.bench.studies.batch_gap.shares import read_pool
from pagedbench.bench.studies.serving.config import load_config as load_serving_config

#: what each knob is allowed to change in the simulator's inputs (the point's and its SimConfig's fields)
SIM_FIELDS = {"max_num_seqs": {"max_num_seqs"}, "policy": {"policy"},
              "max_num_batched_tokens": {"max_num_batched_tokens"}, "output_sigma": {"output_sigma"},
              "block_size": {"allocator"}, "watermark": {"watermark"}, "rate": {"rate"}, "span_s": {"span_s"},
              "window": {"warmup_frac", "cooldown_frac"}, "cost_scale": {"cost_scale"}}


@pytest.fixture(scope="module")
def plan():
    cfg = study.load(study.CONFIG)
    serving = read_serving_point(env_mod.REPO_ROOT / cfg["serving_config"], cfg["dataset"])
    default = default_knobs(serving)
    return cfg, serving, default, study.plan(default, cfg["causes"])


def _sim_inputs(serving, cfg, name, knobs) -> dict:
    """Every input the runner hands the simulator for ``knobs``, flattened to one dict."""
    job = study._jobs([(name, knobs)], serving, [0])[0]
    p = point_of(job)
    sim = sim_config_of(p)
    return {**{f.name: getattr(sim, f.name) for f in dataclasses.fields(sim)}, "allocator": p.allocator,
            "rate": p.rate, "cost_scale": p.cost_scale, "output_sigma": job.knobs.output_sigma,
            "seed": p.seed, "setting": p.setting, "dataset": p.dataset}


def test_each_row_differs_from_the_default_in_its_field_alone(plan):
    cfg, _, default, rows = plan
    assert rows[0] == ("default", default)
    assert len(rows) == len(cfg["causes"]) + 1
    for cause, (name, knobs) in zip(cfg["causes"], rows[1:]):
        assert name == cause.name
        assert changed_fields(default, knobs) == (cause.field,), name


def test_each_row_reaches_the_simulator_through_its_field_alone(plan):
    cfg, serving, default, rows = plan
    base = _sim_inputs(serving, cfg, "default", default)
    for cause, (name, knobs) in zip(cfg["causes"], rows[1:]):
        got = _sim_inputs(serving, cfg, name, knobs)
        differ = {k for k in base if base[k] != got[k]}
        assert differ, f"{name}: the simulator sees no change"
        assert differ <= SIM_FIELDS[cause.field], f"{name}: {sorted(differ)}"


def test_the_default_is_what_the_serving_studys_loader_reads(plan):
    cfg, point, default, _ = plan
    serving = load_serving_config(env_mod.REPO_ROOT / cfg["serving_config"])  # the study's own loader
    first = serving.settings[0]
    d = next(d for d in serving.datasets if d.name == cfg["dataset"])
    assert point.setting == first and point.dataset == d
    _, rate, policy = next(m for m in serving.memory_points if m[0] == cfg["dataset"])
    assert (default.rate, default.policy) == (rate, policy)
    assert default.block_size == next(a.block_size for a in serving.allocators if a.kind == "paged")
    assert (default.max_num_seqs, default.max_num_batched_tokens, default.watermark) == (
        serving.max_num_seqs, serving.max_num_batched_tokens, serving.watermark)
    assert default.span_s == serving.span(first, d)
    assert default.window == (serving.warmup_frac, serving.cooldown_frac)
    assert (point.max_seq_len, point.overload_z, point.gpu_memory_utilization) == (
        serving.max_seq_len(first, d), serving.overload_z, serving.gpu_memory_utilization)


def test_a_serving_config_without_the_point_is_refused(tmp_path):
    bad = tmp_path / "serving.yaml"
    bad.write_text("settings: [{name: a, model: opt-13b, hardware: a100-40gb}]\ndatasets: []\n"
                   "memory_points: []\nallocators: []\n")
    with pytest.raises(ValueError, match="needs a dataset, a memory point and a paged allocator for 'sharegpt'"):
        read_serving_point(bad)


def test_a_bad_cause_is_refused_with_its_name(plan):
    d = plan[2]
    with pytest.raises(BatchGapConfigError, match=r"unknown knob 'block'.*known: max_num_seqs"):
        knobs_for(d, Cause("x", "block", 8, ""))
    with pytest.raises(BatchGapConfigError, match="is the default's value"):
        knobs_for(d, Cause("same", "block_size", d.block_size, ""))
    with pytest.raises(BatchGapConfigError, match="changes a field twice"):
        combined(d, [Cause("a", "block_size", 8, ""), Cause("b", "block_size", 32, "")])


def _step(t, tok, res, inte, ext, free, running):
    return StepRecord(t, tok, res, inte, 0, ext, free, running, 0)


def test_shares_of_a_hand_made_pool_equal_the_hand_computation():
    # a 64-slot pool; two steps inside the window [0, 2], one after it (left out, but it ends step 2)
    steps = [_step(0.0, 20, 4, 2, 0, 38, 2), _step(1.0, 30, 2, 0, 8, 24, 3), _step(3.0, 60, 4, 0, 0, 0, 9)]
    r = read_pool(steps, 64, (0.0, 2.0))
    assert r.num_steps == 2
    assert r.token_of_pool == pytest.approx(50 / 128)  # (20 + 30) / (2 steps x 64 slots)
    assert r.token_of_held == pytest.approx(50 / 58)  # / (20 + 4 + 2) + (30 + 2 + 0): free and external out
    assert r.reserved_of_pool == pytest.approx(6 / 128)
    assert r.internal_of_pool == pytest.approx(2 / 128)
    assert r.free_of_pool == pytest.approx((38 + 8 + 24) / 128)
    assert r.mean_batch == pytest.approx(2.5)
    assert r.mean_batch_time_weighted == pytest.approx((1.0 * 2 + 2.0 * 3) / 3.0)
    parts = r.token_of_pool + r.reserved_of_pool + r.internal_of_pool + r.free_of_pool
    assert parts == pytest.approx(1.0)


def test_a_window_with_no_step_is_refused():
    with pytest.raises(ValueError, match="no step starts inside the window"):
        read_pool([_step(5.0, 1, 0, 0, 0, 63, 1)], 64, (0.0, 2.0))
    with pytest.raises(ValueError, match="total_slots must be >= 1"):
        read_pool([_step(0.0, 1, 0, 0, 0, 63, 1)], 0, (0.0, 2.0))


def _rows(values, key="mean_batch"):
    return [{"seed": s, "overloaded": False, key: v, **{k: 0.5 for k in decompose.FIGURES if k != key}}
            for s, v in enumerate(values)]


def test_paired_deltas_and_what_the_combined_run_takes():
    base = _rows([20.0, 22.0, 24.0])
    moved = decompose.summarize("slow", base, _rows([23.0, 25.2, 26.8]), noise_z=2.0)
    assert moved["delta"]["mean_batch"]["mean"] == pytest.approx(3.0)
    assert moved["matters"]
    noisy = decompose.summarize("noisy", base, _rows([25.0, 18.0, 24.0]), noise_z=2.0)
    assert not noisy["matters"]  # a mean move of +0.33 with a standard error of 2.3
    tiny = decompose.summarize("tiny", base, _rows([20.1, 22.1, 24.1]), noise_z=2.0)
    assert not tiny["matters"]  # resolved by the seeds, but under 2% of the batch
    causes = [Cause("slow", "cost_scale", [["attention", 2.0]], "", paper=True),
              Cause("noisy", "output_sigma", 1.2, "", paper=True), Cause("mine", "block_size", 8, "")]
    summaries = {"slow": moved, "noisy": noisy, "mine": {**moved, "name": "mine"}}
    assert [c.name for c in decompose.to_combine(causes, summaries)] == ["slow"]


def test_littles_law_per_token_time():
    # the paper's 30.42 requests at 2 req/s, 337.99 tokens each: 45.0 ms per output token in the batch
    assert decompose.per_token_ms(30.42, 2.0, 337.99) == pytest.approx(45.0, abs=0.01)
