"""The memory simulator's accounting: hand-computed tiny traces step by step, the slot identity on every
step, preemption, external fragmentation, buddy rounding, the sharing measure, and the study end to end."""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref

import pytest
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, StepRecord, sharing_saving, simulate
from pagedbench.bench.studies.memory import study as memory_study
from pagedbench.bench.workloads import Request, synthetic
from pagedbench.refengine import BlockManager

PAGED4, PAGED2 = AllocatorSpec("paged", 4), AllocatorSpec("paged", 2)


def cfg(kv_slots: int) -> SimConfig:
    return SimConfig(kv_slots=kv_slots, max_seq_len=2 * kv_slots, step_s=1.0, watermark=0.0, warmup_frac=0.0)


def rows(result) -> list[tuple]:
    """(time, token, reserved, internal, rounding, external, free, running, waiting) per step."""
    return [tuple(s.__getattribute__(f) for f in StepRecord.__slots__) for s in result.steps]


def test_paged_hand_computed():
    trace = (Request(0, 3, 2), Request(1, 2, 1))  # both at t=0; pool: 2 blocks of 4
    r = simulate(trace, PAGED4, cfg(8), record_steps=True)
    assert rows(r) == [
        (0.0, 3 + 2, 1, 2, 0, 0, 0, 2, 0),  # prompts: A holds 3 of its 4 (P + O - 1), B 2 of 2 in 4 slots
        (1.0, 4, 0, 0, 0, 0, 4, 1, 0),  # B left after its one token; A's decode fills its block
    ]
    assert (r.num_steps, r.peak_running, r.mean_running) == (2, 2, 1.5)
    assert (r.num_finished, r.num_preemptions) == (2, 0)
    assert r.shares.token_states == 9 / 16 and r.shares.internal_fragmentation == 2 / 16
    assert r.mean_normalized_latency_s == pytest.approx(((2 - 0) / 2 + (1 - 0) / 1) / 2)


def test_paged_preempts_the_newest_and_readmits_it_first():
    trace = (Request(0, 2, 3), Request(1, 1, 2))  # pool: 2 blocks of 2; A will need both
    r = simulate(trace, PAGED2, cfg(4), record_steps=True)
    assert rows(r) == [
        (0.0, 3, 1, 0, 0, 0, 0, 2, 0),
        (1.0, 3, 1, 0, 0, 0, 0, 1, 1),  # A's decode needed B's block: B preempted, back to the queue
        (2.0, 4, 0, 0, 0, 0, 0, 1, 1),  # B refused (no free block): paged memory is never "external"
        (3.0, 2, 0, 0, 0, 0, 2, 1, 0),  # A left; B re-admitted (prompt + its token, recomputed), done
    ]
    assert r.num_preemptions == 1 and r.num_finished == 2


def test_preempted_request_goes_back_to_the_head_of_the_queue():
    trace = (Request(0, 2, 3), Request(1, 1, 2), Request(2, 3, 1))  # pool: 2 blocks of 2
    r = simulate(trace, PAGED2, cfg(4), record_steps=True)
    assert rows(r) == [
        (0.0, 3, 1, 0, 0, 0, 0, 2, 1),  # C (2 blocks) refused
        (1.0, 3, 1, 0, 0, 0, 0, 1, 2),  # A's decode preempts B
        (2.0, 4, 0, 0, 0, 0, 0, 1, 2),
        (3.0, 2, 0, 0, 0, 0, 2, 1, 1),  # B, back at the head, goes before C (which does not fit beside it)
        (4.0, 3, 0, 1, 0, 0, 0, 1, 0),
    ]


@pytest.mark.parametrize("fast", [False, True])
def test_a_callers_prompts_are_checked_and_the_simulators_own_are_not_read_again(fast, monkeypatch):
    from pagedbench.refengine.errors import InvalidArgumentError
    from pagedbench.refengine.kv import token_checks

    trace = (Request(0, 3, 2), Request(1, 2, 1))
    with pytest.raises(InvalidArgumentError, match="got -1"):
        simulate(trace, PAGED4, cfg(8), prompt_tokens=lambda r: [1] * (r.prompt_len - 1) + [-1], fast_forward=fast)
    reads = []
    real = token_checks.checked_token_list
    monkeypatch.setattr(token_checks, "checked_token_list", lambda ids: reads.append(len(ids)) or real(ids))
    monkeypatch.setattr("pagedbench.refengine.engine.core.checked_token_list", token_checks.checked_token_list)
    monkeypatch.setattr("pagedbench.refengine.kv.block_manager.checked_token_list", token_checks.checked_token_list)
    simulate(trace, PAGED4, cfg(8), fast_forward=fast)  # its zeros, made by the simulator
    assert reads == []
    simulate(trace, PAGED4, cfg(8), prompt_tokens=lambda r: [1] * r.prompt_len, fast_forward=fast)
    assert reads == [3, 2]  # each prompt read once, where it entered


def test_first_fit_external_fragmentation_hand_computed():
    spec = AllocatorSpec("orca", 1, "oracle", "first_fit")
    trace = (Request(0, 3, 1), Request(1, 1, 2), Request(2, 2, 1), Request(3, 4, 1))  # all at t=0
    r = simulate(trace, spec, cfg(10), record_steps=True)
    # Oracle reserves prompt + output; the last output token is never stored, so one slot of each
    # reservation is internal fragmentation
    assert rows(r) == [
        (0.0, 3 + 1 + 2, 1, 3, 0, 0, 0, 3, 1),  # A [0,4) B [4,7) C [7,10); D (5 slots) waits
        (1.0, 2, 0, 1, 0, 7, 0, 1, 1),  # A, C left: holes of 4 and 3 hold 7 slots, none holds D's 5
        (2.0, 4, 0, 1, 0, 0, 5, 1, 0),  # D placed at 0; the free half is not fragmentation
    ]


def test_buddy_rounding_is_internal_fragmentation_and_reported_apart():
    trace = (Request(0, 2, 1), Request(1, 5, 1))
    r = simulate(trace, AllocatorSpec("orca", 1, "oracle"), cfg(8), record_steps=True)
    assert rows(r) == [
        (0.0, 2, 0, 2, 1, 0, 4, 1, 1),  # A: 3 slots reserved, buddy block of 4; B needs 8 > 4 free: not
        (1.0, 5, 0, 3, 2, 0, 0, 1, 0),  # fragmentation, too little memory. B: 6 reserved, block of 8
    ]


def test_separate_policy_runs_prompt_steps_apart():
    trace = (Request(0, 3, 3), Request(1, 2, 2, arrival_s=0.5))
    mixed = simulate(trace, PAGED4, cfg(16), record_steps=True)
    separate = simulate(trace, PAGED4, dataclasses.replace(cfg(16), policy="separate"), record_steps=True)
    # mixed: B's prompt joins A's decode at t=1; separate: a step of B's prompt alone, A waits a step
    assert [s.num_running for s in mixed.steps] == [1, 2, 2]
    assert [s.token_states for s in separate.steps] == [3, 5, 7, 5]
    assert separate.num_steps == mixed.num_steps + 1


def test_orca_max_holds_what_its_reservations_allow():
    trace = synthetic("sharegpt", 60, rate=4.0, seed=3)
    r = simulate(trace, AllocatorSpec("orca", 1, "max"), SimConfig(step_s=0.05))
    assert r.peak_running == 7  # 15,700 slots: 4 + 2 + 1 buddy blocks of 2,048
    assert r.shares.internal_fragmentation > 0.3 and r.shares.rounding_waste == 0
    assert r.shares.external_fragmentation == 0 and r.shares.free > 0  # 1,364 slots too few for 2,048


SPECS = [AllocatorSpec("orca", 1, "max"), AllocatorSpec("orca", 1, "pow2"), AllocatorSpec("orca", 1, "oracle",
         "first_fit"), AllocatorSpec("paged", 1), AllocatorSpec("paged", 16), AllocatorSpec("paged", 64)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_slots_add_up_on_every_step(spec):
    trace = synthetic("sharegpt", 40, rate=8.0, seed=1, max_seq_len=512)
    config = SimConfig(kv_slots=1500, max_seq_len=512, step_s=0.05, warmup_frac=0.3)
    r = simulate(trace, spec, config, record_steps=True)
    assert r.steps and r.num_steps == len(r.steps) and r.num_finished == len(trace)  # drained
    lo, hi = 0.3 * trace[-1].arrival_s, trace[-1].arrival_s  # the measured window
    measured = [s for s in r.steps if lo <= s.time_s <= hi]
    cut = simulate(trace, spec, dataclasses.replace(config, drain=False), record_steps=True)
    assert cut.steps == r.steps[:len(cut.steps)] and all(s.time_s <= hi for s in cut.steps)
    assert cut.shares == r.shares and cut.num_measured_steps == r.num_measured_steps
    assert r.num_measured_steps == len(measured)
    assert r.mean_running == pytest.approx(sum(s.num_running for s in measured) / len(measured))
    assert r.shares.free == pytest.approx(sum(s.free for s in measured) / len(measured) / r.total_slots)
    for s in r.steps:
        parts = (s.token_states, s.reserved, s.internal_fragmentation, s.external_fragmentation, s.free)
        assert min(parts) >= 0 and sum(parts) == r.total_slots, s
        assert 0 <= s.rounding_waste <= s.internal_fragmentation
    sh = r.shares
    total = sh.token_states + sh.reserved + sh.internal_fragmentation + sh.external_fragmentation + sh.free
    assert total == pytest.approx(1.0)


def test_requests_that_cannot_fit_are_refused():
    with pytest.raises(ValueError, match="request 0: 17 tokens exceed max_seq_len 16"):
        simulate((Request(0, 9, 8),), PAGED4, cfg(8))
    with pytest.raises(ValueError, match="request 0: stores 10 tokens, more than the pool's 8 slots"):
        simulate((Request(0, 5, 6),), PAGED4, cfg(8))
    with pytest.raises(ValueError, match=r"request 0 can never be admitted by Orca \(Max\) with 6 slots"):
        simulate((Request(0, 4, 1),), AllocatorSpec("orca", 1, "max"),
                 SimConfig(kv_slots=6, max_seq_len=8, step_s=1.0))


@pytest.mark.parametrize("enabled", [True, False])
def test_a_run_pauses_cycle_collection_and_restores_it(enabled):
    """The cycle collector is off while the run steps (it would only walk live objects) and as it was
    after, the run ending or raising."""
    seen = []
    trace = (Request(0, 3, 2), Request(1, 2, 1))
    (gc.enable if enabled else gc.disable)()
    try:
        simulate(trace, PAGED4, cfg(8), on_step=lambda: seen.append(gc.isenabled()))
        assert seen and not any(seen) and gc.isenabled() is enabled
        with pytest.raises(ValueError, match="can never be admitted"):
            simulate((Request(0, 4, 1),), AllocatorSpec("orca", 1, "max"), SimConfig(kv_slots=6, max_seq_len=8))
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


@pytest.mark.parametrize("fast", [True, False])
def test_a_run_is_freed_by_reference_counting(fast):
    """A run leaves no cycle holding its objects (the collector is paused while it steps): they go as it
    returns, the block manager with them."""
    refs = []

    class Weak(BlockManager):  # (a weak reference needs a class without slots)
        pass

    def manager(spec, cfg):
        bm = Weak(cfg.kv_slots // spec.block_size, spec.block_size)
        refs.append(weakref.ref(bm))
        return bm

    gc.disable()
    try:
        trace = tuple(Request(i, 3 + i % 5, 2 + i % 7, 0.3 * i) for i in range(30))
        result = simulate(trace, PAGED4, cfg(64), make_manager=manager, account=False, fast_forward=fast)
        assert result.num_finished == 30 and refs and refs[0]() is None
    finally:
        gc.enable()


def test_sharing_saving_hand_computed():
    one = (Request(0, 4, 2),)  # block size 4: the full prompt block is shared, each sample adds one
    assert sharing_saving(one, 2, 4) == pytest.approx(1 - (3 + 3) / (4 + 4))
    assert sharing_saving(one, 1, 4) == 0.0
    partial = (Request(0, 3, 1),)  # a partial prompt block is copied on the first append: no saving
    assert sharing_saving(partial, 3, 4) == 0.0


def test_study_end_to_end(tmp_path):
    config = tmp_path / "memory.yaml"
    config.write_text("""
kv_slots: 2000
max_seq_len: 512
watermark: 0.01
warmup_frac: 0.1
seed: 0
model: opt-13b
hardware: a100-40gb
workloads:
  - {name: sharegpt@2, dataset: sharegpt, num_requests: 30, rate: 2.0}
orca_policies: [max, pow2, oracle]
orca_placements: [buddy]
block_sizes: [4, 16]
vllm_block_size: 16
sharing: {dataset: alpaca, num_requests: 5, block_size: 16, n: [2]}
""")
    memory_study.main(["--config", str(config), "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "memory.json").read_text())
    assert doc["environment"]["git"]["commit"] and doc["environment"]["device"]["backend"] == "cpu"
    assert len(doc["runs"]) == 3 + 2 and len(doc["sharing"]) == 1
    run = doc["runs"][0]
    assert run["allocator"]["kind"] == "orca" and set(run["shares"]) >= {"token_states", "free"}
    text = (tmp_path / "memory.md").read_text()
    assert "| max " in text and "serving.md" in text and "Environment" in text and "Figure 18b" in text
    assert (tmp_path / "memory_block_size.png").stat().st_size > 0


def test_sim_speed_replays_the_block_managers_calls(tmp_path, monkeypatch):
    from pagedbench.bench.studies.sim_speed import study as sim_speed
    from pagedbench.refengine.engine.core import EngineCore

    real_steps, real_step = [0], EngineCore.step

    def counting_step(self):
        real_steps[0] += 1
        return real_step(self)

    monkeypatch.setattr(EngineCore, "step", counting_step)
    r = sim_speed.measure(40, 4.0, kv_slots=4096)
    assert r["generated_tokens"] > 0 and r["block_manager_calls"] >= r["generated_tokens"] - 40
    assert r["simulation_wall_s"] > 0 and r["block_manager_wall_s"] > 0 and r["ratio"] > 0
    # two runs step by step (timed, recorded), and two fast-forwarded (timed, compared with the recorded one),
    # each with its steps served one at a time
    assert real_steps[0] == 2 * r["num_steps"] + 2 * r["num_single_steps"] and r["num_single_steps"] < r["num_steps"]
    text = sim_speed.markdown({"result": r, "environment": sim_speed.env_mod.environment()})
    assert f"{r['num_single_steps']:,} of {r['num_steps']:,} steps" in text


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt_len": 3}', "sample.jsonl:2: missing field 'output_len'"),
    ('{"prompt_len": -3, "output_len": 2}', "sample.jsonl:2: field 'prompt_len' must be an int >= 1, got -3"),
    ('{"prompt_len": 3, "output_len": 2, "arrival_s": -1}', "sample.jsonl:2: field 'arrival_s' must be a number"),
    ('{"prompt_len": 3, "output_len": 2.5}', "sample.jsonl:2: field 'output_len' must be an int >= 1"),
    ("not json", "sample.jsonl:2: not a JSON object"),
])
def test_trace_errors_name_file_line_and_field(tmp_path, line, message):
    from pagedbench.bench.workloads import load_jsonl

    path = tmp_path / "sample.jsonl"
    path.write_text('{"prompt_len": 3, "output_len": 2, "arrival_s": 0.5}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)


def test_an_earlier_commits_simulator_is_timed_on_the_same_trace_in_a_subprocess():
    """HEAD's committed simulator, imported from its extracted copy (not the installed package), serves the trace
    as this one does; a commit this clone lacks is reported, not raised."""
    from pagedbench.bench.studies.sim_speed.baseline import time_commit
    from pagedbench.bench.workloads import synthetic

    base = time_commit("HEAD", num_requests=40, rate=4.0, block_size=16, kv_slots=4096, repeats=2)
    assert "unavailable" not in base, base
    assert len(base["walls_s"]) == 2 and base["wall_s"] == min(base["walls_s"])  # the fastest of its runs
    here = simulate(synthetic("sharegpt", 40, rate=4.0, seed=0), AllocatorSpec("paged", 16),
                    SimConfig(kv_slots=4096, step_s=0.08, policy="mixed"), account=False)
    assert (base["generated_tokens"], base["num_steps"]) == (here.num_generated_tokens, here.num_steps)
    assert base["wall_s"] > 0 and base["simulated_s"] == pytest.approx(here.simulated_s)
    assert "not found" in time_commit("0" * 40, num_requests=4, rate=4.0, block_size=16, kv_slots=4096)["unavailable"]


def test_sim_speed_takes_the_fastest_of_its_repeats_for_every_simulation(monkeypatch):
    """Each simulation runs ``repeats`` times and its time is the fastest run (the goal's simulator's too,
    asked for as many); the steps the engine's loop serves are counted per run, and bad counts are refused."""
    from pagedbench.bench.studies.sim_speed import study as sim_speed

    asked = []

    def baseline(commit, **kw):
        asked.append(kw["repeats"])
        return {"commit": commit, "unavailable": "not timed here"}

    monkeypatch.setattr(sim_speed, "time_commit", baseline)
    once = sim_speed.measure(20, 4.0, kv_slots=4096)
    r = sim_speed.measure(20, 4.0, kv_slots=4096, repeats=3)
    assert asked == [1, 3] and r["repeats"] == 3
    for key, walls in (("simulation_wall_s", "simulation_walls_s"), ("fast_forward_wall_s", "fast_forward_walls_s")):
        assert len(r[walls]) == 3 and r[key] == min(r[walls])
    assert r["num_single_steps"] == once["num_single_steps"] and r["generated_tokens"] == once["generated_tokens"]
    assert "fastest of 3 runs" in sim_speed.markdown({"result": r, "environment": sim_speed.env_mod.environment()})
    assert "fastest of" not in sim_speed.markdown({"result": once, "environment": sim_speed.env_mod.environment()})
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        sim_speed.measure(20, 4.0, kv_slots=4096, repeats=0)


def test_sim_speed_times_the_goals_simulator_only_on_the_same_schedule(monkeypatch):
    from pagedbench.bench.studies.sim_speed import study as sim_speed

    def other(commit, **kw):  # an older simulator that served another schedule
        return {"commit": commit, "wall_s": 9.0, "cpu_s": 9.0, "generated_tokens": 1, "num_steps": 1,
                "simulated_s": 1.0}

    monkeypatch.setattr(sim_speed, "time_commit", other)
    r = sim_speed.measure(20, 4.0, kv_slots=4096)
    assert "differs" in r["goal_baseline"]["unavailable"] and r["fast_forward_speedup_over_baseline"] is None
    text = sim_speed.markdown({"result": r, "environment": sim_speed.env_mod.environment()})
    assert "was not timed: its trace or schedule differs" in text

    def same(commit, **kw):
        return {**other(commit), "generated_tokens": r["generated_tokens"], "num_steps": r["num_steps"]}

    monkeypatch.setattr(sim_speed, "time_commit", same)
    r = sim_speed.measure(20, 4.0, kv_slots=4096)
    assert r["fast_forward_speedup_over_baseline"] == pytest.approx(9.0 / r["fast_forward_wall_s"])
    text = sim_speed.markdown({"result": r, "environment": sim_speed.env_mod.environment()})
    assert "when the goal was set" in text and f"{r['fast_forward_speedup_over_baseline']:.2f}×" in text


def test_sim_speed_times_each_run_with_no_earlier_result_alive():
    """A simulation's result holds millions of references; one kept alive slows the next run, so no timed run
    starts with an earlier one's result alive, and runs that compute differently are refused."""
    from pagedbench.bench.studies.sim_speed import study as sim_speed

    class Result:
        def __init__(self, tokens: int) -> None:
            self.num_generated_tokens, self.num_steps = tokens, 1

    made: list[weakref.ref] = []

    def run(tokens=(5, 5, 5)):
        assert all(r() is None for r in made), "an earlier run's result is alive"
        result = Result(tokens[len(made)])
        made.append(weakref.ref(result))
        return result

    assert len(sim_speed._timed(3, run)) == 3
    made.clear()
    with pytest.raises(AssertionError, match="two runs of one simulation differ"):
        sim_speed._timed(3, lambda: run((5, 5, 6)))
