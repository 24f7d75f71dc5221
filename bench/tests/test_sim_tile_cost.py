"""The serving simulator on the tile step cost: fast-forwarded runs make step-by-step simulation's schedule
with it too, a setting's ``linear_model`` reaches the point's cost model and key, and a serving point
on it runs and prices its steps otherwise than on the roofline."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from pagedbench.bench import workloads
from pagedbench.bench.costmodel import StepCostModel, load_hardware, load_model
from pagedbench.bench.costmodel.tile_step_cost import TileStepCost
from pagedbench.bench.sim import points as serving_points
from pagedbench.bench.sim.run import default_manager
from pagedbench.bench.sim.settings import Setting
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.refengine.engine.core import StepShape

SETTING = Setting("8b", "llama-3.1-8b", "a100-80gb", max_seq_len=2048)
TILE = dataclasses.replace(SETTING, linear_model="tile")


def test_decode_run_is_the_tile_steps_own_time():
    from pagedbench.bench.sim.fast_forward import decode_run_of

    fn = serving_points.step_time_fn(serving_points.cost_model(TILE))
    for ctx in ((5, 900, 31), tuple(range(1, 130)), tuple(range(200, 330))):  # 129 and 130 decode rows: a tile past
        run = decode_run_of(fn)(ctx)
        for j in (0, 1, 77):
            assert run(j) == fn(StepShape((), tuple(c + j for c in ctx)))


@pytest.mark.parametrize("dataset,rate", [("sharegpt", 5.0), ("sharegpt", 30.0), ("alpaca", 200.0)])
def test_fast_forward_is_step_by_step_on_the_tile_cost(dataset, rate):
    trace = workloads.synthetic(dataset, 300, rate=rate, seed=3, max_seq_len=1024)
    cfg = SimConfig(kv_slots=100_000, max_seq_len=1024, max_num_seqs=160, max_num_batched_tokens=512, policy="mixed")
    step_time = serving_points.step_time_fn(serving_points.cost_model(TILE))
    managers, runs = [], []

    def manager(spec, cfg):
        managers.append(default_manager(spec, cfg))
        return managers[-1]

    for fast in (False, True):
        r = simulate(trace, AllocatorSpec("paged", 16), cfg, step_time_s=step_time, account=False,
                     make_manager=manager, fast_forward=fast)
        runs.append((r, managers[-1].metrics(), managers[-1].free_block_ids()))
    assert runs[1] == runs[0] and runs[0][0].num_finished == len(trace)
    if rate > 5:
        assert runs[0][0].peak_running > 128  # decode batches past the 128-row tile were priced


def test_the_setting_picks_the_linear_model_and_a_bad_one_is_refused():
    assert type(serving_points.cost_model(TILE)) is TileStepCost
    assert type(serving_points.cost_model(SETTING)) is StepCostModel
    scaled = serving_points.cost_model(TILE, (("attention", 2.0), ("step_overhead", 3.0)))
    assert type(scaled) is TileStepCost and scaled.linear_curve == serving_points.cost_model(TILE).linear_curve
    hardware = load_hardware("a100-80gb")
    assert scaled.fixed_s == pytest.approx(3 * hardware.step_overhead_s)
    with pytest.raises(ValueError, match="setting '8b': linear_model='tiled'; expected one of 'roofline', 'tile'"):
        dataclasses.replace(SETTING, linear_model="tiled")


def _point(setting: Setting) -> serving_points.Point:
    method = serving_points.Method(30.0, 20, 0.1, 0.1, 3.0, 256, 512, 0.01, ("distserve-llama-3.1-8b",))
    return serving_points.Point(setting, serving_points.Dataset("sharegpt", "sharegpt"), AllocatorSpec("paged", 16),
                                "mixed", rate=12.0, seed=0, max_seq_len=2048, kv_slots=200_000, account=False,
                                method=method)


def test_a_roofline_points_key_is_what_it_was_before_the_option():
    p = _point(SETTING)
    cost = serving_points.cost_model(SETTING)
    fields = dataclasses.asdict(p)
    del fields["group"], fields["setting"]["linear_model"], fields["dataset"]["workload"]  # later fields, at default
    old = json.dumps([serving_points.SIM_VERSION, fields, dataclasses.asdict(cost)], sort_keys=True)
    assert p.key(cost) == hashlib.sha256(old.encode()).hexdigest()[:24]
    assert _point(TILE).key(serving_points.cost_model(TILE)) != p.key(cost)


def test_a_serving_point_on_the_tile_cost_runs_and_prices_steps_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_SERVING_CACHE", str(tmp_path))
    rows = {s.linear_model: serving_points.run_point(_point(s)) for s in (SETTING, TILE)}
    for row in rows.values():
        assert not row["overloaded"] and row["num_window_arrivals"] > 0 and row["num_unfinished"] == 0
    assert len(list(tmp_path.iterdir())) == 2  # two points, cached apart
    assert rows["tile"]["simulated_s"] != rows["roofline"]["simulated_s"]
    assert rows["tile"]["mean_tpot_ms"] != rows["roofline"]["mean_tpot_ms"]
    # the same step priced by each: a decode step of 136 rows is a tile past 128 on the tile model only
    model, gpu = load_model("llama-3.1-8b"), load_hardware("a100-80gb")
    for linear, ratio in (("roofline", (1.0, 136 / 128)), ("tile", (1.15, 2.0))):
        fn = serving_points.step_time_fn(StepCostModel.from_profiles(model, gpu, linear=linear))
        r = fn(StepShape((), (500,) * 136)) / fn(StepShape((), (500,) * 128))
        assert ratio[0] < r < ratio[1], (linear, r)
