"""The calibration study on the tiny model (``--quick``): the record it writes, the fit against a constant,
the schedule check of the validation, the strict config and the atomic write."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from pagedbench.bench.costmodel import ProfileError, StepBatch
from pagedbench.bench.costmodel.after_prefill import AfterPrefillCost
from pagedbench.bench.costmodel.batched_cost import BATCHED_TERMS, BatchedStepCost
from pagedbench.bench.costmodel.calibration import (
    TERMS,
    StepSample,
    fit_batched_profile,
    term_identifiability,
    this_machine,
)
from pagedbench.bench.studies.calibrate import study as calibrate
from pagedbench.bench.studies.calibrate.config import CONFIG, join_pairs, load_config, model_config
from pagedbench.bench.studies.calibrate.report import write_atomic
from pagedbench.bench.studies.calibrate.steps import (
    PricedAfterPrefill,
    StepGrid,
    TimedStep,
    build_engine,
    decode_errors_since_prefill,
    run_engine,
    step_batch,
)
from pagedbench.bench.studies.calibrate.validation import compare, serve_real, serve_simulated, validation_trace
from pagedbench.refengine import ModelConfig, load_model
from pagedbench.refengine.engine.core import StepShape


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("calibration")
    calibrate.main(["--quick", "--out", str(out)])
    return out, json.loads((out / "calibration.json").read_text())


def _cost(coefficients: dict[str, float]) -> BatchedStepCost:
    return BatchedStepCost(label="from the record", **coefficients)


def _shape(sample: dict) -> StepShape:
    return StepShape(tuple(map(tuple, sample["prefill_chunks"])), tuple(sample["decode_context_lens"]))


def _batch(sample: dict) -> StepBatch:
    return step_batch(_shape(sample))


def _extras(record: dict, cost=None, clock: str = "wall") -> np.ndarray:
    """What a prefill costs each grid step after it, as the record's ``clock`` fit charges it beside ``cost``
    (steps in order; with ``cost``, bounded as the fits price it: steps.PricedAfterPrefill)."""
    cal = record["calibration"]
    after = AfterPrefillCost.from_record(cal["after_prefill"] if clock == "wall" else cal["cpu_clock"]["after_prefill"])
    priced = after if cost is None else PricedAfterPrefill(after, cost)
    return np.array(priced.extras_in_order(_shape(s) for s in record["calibration"]["samples"]))


def test_quick_run_writes_one_record_with_every_section(quick_run):
    out, record = quick_run
    assert sorted(p.name for p in out.iterdir()) == ["calibration.json", "calibration.md"]  # no temp files
    assert record["schema_version"] == 1 and record["study"] == "calibration"
    assert record["environment"]["git"].keys() == {"commit", "dirty"}
    assert record["config"]["quick"] and record["config"]["engine"]["model"] == "tiny"
    assert len(record["machine_load"]["loadavg_before"]) == 3
    cal = record["calibration"]
    assert cal["machine"] == this_machine().to_record()  # the CPU the fit prices (a check elsewhere refits)
    cpu_after = cal["cpu_clock"]["after_prefill"]  # the same runs' aftermath in CPU time, for the CPU fit
    assert (cpu_after["batches"], cpu_after["prefill_tokens"]) == (cal["after_prefill"]["batches"],
                                                                   cal["after_prefill"]["prefill_tokens"])
    assert cpu_after["pairs"] != cal["after_prefill"]["pairs"]  # another clock's timings of the same steps
    floor = cal["after_prefill_floor"]  # the steps a noisy aftermath would take below the floor, counted
    assert floor["wall"]["num_samples"] == floor["cpu"]["num_samples"] == cal["num_samples"]
    assert 0 <= floor["wall"]["num_clipped"] <= cal["num_samples"]
    assert tuple(cal["coefficients"]) == BATCHED_TERMS  # the default backend's groups and padding
    assert tuple(cal["linear_terms"]["coefficients"]) == TERMS  # the old five-term fit beside it
    assert cal["num_samples"] == len(cal["samples"]) >= len(BATCHED_TERMS)
    assert all(cal["num_samples_by_kind"][k] > 0 for k in ("decode", "prefill", "mixed"))
    assert cal["fit_errors"]["all"]["num_samples"] == cal["num_samples"]
    v = record["validation"]
    assert v["trace"]["num_requests"] == len(v["requests"]) == 6
    assert [q["quantile"] for q in v["quantiles"]] == [0.5, 0.9, 0.99]
    lat = v["latency"]
    assert lat["goal"] == pytest.approx(max(0.10, 1.5 * lat["real_spread_median"]))
    assert lat["goal_met"] == (lat["median_abs_rel_error"] <= lat["goal"])
    errors = [r["rel_error"] for r in v["requests"]]
    assert lat["median_abs_rel_error"] == pytest.approx(float(np.median(np.abs(errors))))
    assert v["makespan"]["sim_s"] > 0 and record["assumptions"]
    assert record["config"]["engine"]["attention_backend"] == "torch-batched"
    for diagnostic in ("cpu_clock", "median_rescaled", "linear_terms"):  # another clock, level or model
        assert v[diagnostic]["latency"].keys() == lat.keys() and len(v[diagnostic]["quantiles"]) == 3
        assert len(cal[diagnostic]["coefficients"]) == len(TERMS if diagnostic == "linear_terms" else BATCHED_TERMS)
    assert cal["median_rescaled"]["fit_errors"]["all"]["median_signed"] == pytest.approx(0.0, abs=1e-9)
    assert record["validity"]["valid"] == (lat["goal_met"] and v["schedule"]["same_steps"])
    md = (out / "calibration.md").read_text()
    for heading in ("## Calibration", "## Validation", "## Assumptions", "latency p99", "makespan",
                    "## Waking an idle engine", "[calibration_online.md](calibration_online.md)",
                    "## Decode steps by their distance from a prefill",
                    "## What a prefill costs the decode steps after it", "without a prefill's cost"):
        assert heading in md
    decodes = sum(s["kind"] == "decode" for s in cal["samples"])
    assert sum(r["num_steps"] for r in cal["decode_since_prefill"]) == decodes  # each grid decode in one bucket
    assert [r["since_prefill"] for r in v["decode_since_prefill"]] == ["1", "2", "3", "4-7", "8+"]
    after = cal["after_prefill"]  # the quick grid's batches x joining prompts, a pair per join and step
    assert after["batches"] == [1, 4] and after["prefill_tokens"] == [8, 32]
    assert [[[len(step) for step in cell] for cell in row] for row in after["pairs"]] == [[[2, 2]] * 2] * 2
    assert after["extra_s"] == [[[pytest.approx(float(np.median([a - st for st, a in step]))) for step in cell]
                                 for cell in row] for row in after["pairs"]]
    assert "after it" in cal["label"] and "after it" not in cal["without_after_prefill"]["label"]
    assert v["without_after_prefill"]["latency"].keys() == lat.keys()
    assert [r["since_prefill"] for r in v["without_after_prefill"]["decode_since_prefill"]] == ["1", "2", "3",
                                                                                                "4-7", "8+"]
    wake = cal["wake"]  # the quick grid's waits, each with its pairs per step
    assert wake["gaps_s"] == [0.005, 0.02] and [[len(s) for s in g] for g in wake["pairs"]] == [[2, 2], [2, 2]]
    assert wake["extra_s"] == [[pytest.approx(float(np.median([a - w for w, a in s]))) for s in g]
                               for g in wake["pairs"]]


def test_fitted_model_beats_a_constant_on_its_samples(quick_run):
    """On the CPU clock (the time each step held a core): the wall clock of a loaded machine adds other
    processes' time to some steps, which no model of a step's work can predict."""
    _, record = quick_run
    samples, cpu = record["calibration"]["samples"], record["calibration"]["cpu_clock"]
    measured = np.array([s["cpu_s"] for s in samples])
    cost = _cost(cpu["coefficients"])
    extras = _extras(record, cost, "cpu")  # the aftermath measured in CPU time, as the CPU fit takes it off
    assert np.count_nonzero(extras) > 0  # the quick grid has decode steps right after a prefill
    fitted = (np.array([cost.step_time_s(_batch(s)) for s in samples]) + extras) / measured - 1
    constant = np.sum(1 / measured) / np.sum(1 / measured ** 2)  # the best constant, relative least squares
    baseline = constant / measured - 1
    assert np.sqrt(np.mean(fitted ** 2)) < 0.8 * np.sqrt(np.mean(baseline ** 2))
    assert cpu["fit_errors"]["all"]["rms"] == pytest.approx(np.sqrt(np.mean(fitted ** 2)))
    wall = _cost(record["calibration"]["coefficients"])  # the published (wall) fit's own error, as recorded
    walls = (np.array([wall.step_time_s(_batch(s)) for s in samples]) + _extras(record, wall)) / np.array(
        [s["step_s"] for s in samples]) - 1
    assert record["calibration"]["fit_errors"]["all"]["rms"] == pytest.approx(np.sqrt(np.mean(walls ** 2)))


def test_the_grids_own_steps_identify_every_batched_term(quick_run):
    # On exactly the shapes the grid served, no term moves with the others: a known model is recovered
    # term by term, and each term keeps a share of its own. The two decode-key terms part only where a
    # bucket holds unlike lengths (spread_contexts shares buckets); one length per bucket gives ~0.005.
    _, record = quick_run
    truth = _cost(dict(zip(BATCHED_TERMS, (2e-3, 5e-5, 3e-5, 4e-7, 2e-8, 2e-4, 3e-7, 5e-8, 6e-4))))
    batches = [_batch(s) for s in record["calibration"]["samples"]]
    samples = [StepSample(b, truth.step_time_s(b)) for b in batches]
    fitted = fit_batched_profile(samples)
    for name in BATCHED_TERMS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-4), name
    share = term_identifiability(samples)
    assert min(share["decode_attn_s_per_context_token"], share["decode_attn_s_per_padded_key"]) > 0.03, share
    assert min(v for t, v in share.items() if "decode_attn" not in t) > 0.2, share
    assert record["calibration"]["identifiability"].keys() == set(BATCHED_TERMS)


def test_a_join_run_mixes_each_short_prompt_into_a_full_decode_batch():
    cfg = load_config(quick=True)
    e = cfg.engine
    loaded = load_model(ModelConfig.from_yaml(Path(CONFIG).parent / "models.yaml", name=e.model),
                        dtype=e.dtype, attention_backend=e.attention_backend, seed=e.seed)
    llm, timer = build_engine(loaded, e)
    grid = StepGrid(llm, timer, cfg)
    batch = max(cfg.grid.join_batches)
    steps = grid.join_run(batch, rotate=1)
    joined = [s.shape for s in steps if s.kind == "mixed" and len(s.shape.decode_context_lens) == batch]
    # every join, one then two short prompts at a time, each whole (no cached context) beside every decode
    assert [tuple(q for q, _ in shape.prefill_chunks) for shape in joined] == list(join_pairs(
        cfg.grid.join_prefill_lens))
    assert all(q == ctx for shape in joined for q, ctx in shape.prefill_chunks)
    # the decodes' prompts cycle through spread_contexts from the rotation on: several lengths, one batch
    assert len({n for n in joined[0].decode_context_lens}) == min(batch, len(cfg.grid.spread_contexts))
    assert not llm.core.has_unfinished() and run_engine(llm, timer) == []


def test_join_pairs_are_each_length_alone_then_unlike_pairs():
    assert join_pairs((3, 7, 12)) == ((3,), (7,), (12,), (3, 12), (7, 3), (12, 7))
    assert join_pairs((5,)) == ((5,),)


def test_quick_validation_compared_equal_schedules(quick_run):
    _, record = quick_run
    sched = record["validation"]["schedule"]
    assert sched["same_steps"] and sched["same_tokens_in_real_runs"]
    assert sched["num_steps"]["real_a"] == sched["num_steps"]["real_b"] == sched["num_steps"]["sim"] > 0


def test_the_schedule_check_catches_a_different_schedule():
    cfg = load_config(quick=True)
    e = cfg.engine
    loaded = load_model(ModelConfig.from_yaml(Path(CONFIG).parent / "models.yaml", name=e.model),
                        dtype=e.dtype, attention_backend=e.attention_backend, seed=e.seed)
    trace = validation_trace(cfg, loaded.config.vocab_size)
    real = serve_real(loaded, e, trace)
    cost = _cost(dict(zip(BATCHED_TERMS, (1e-3, 1e-5, 1e-4, 1e-7, 1e-8, 1e-4, 1e-7, 1e-8, 1e-4))))
    same = serve_simulated(e, trace, cost)
    assert same.shapes == real.shapes
    # each request's finish step: its wall latency holds the steps' own time up to it (and the moments
    # between steps, which a loaded machine stretches: no tighter bound holds), its CPU latency their CPU time
    assert max(real.finish_steps) == len(real.steps) - 1
    wall = np.cumsum([s.step_s for s in real.steps])
    assert all(wall[i] <= lat for i, lat in zip(real.finish_steps, real.latencies_s))
    cpu = real.on_cpu_clock()
    assert cpu.latencies_s == tuple(float(np.cumsum([s.cpu_s for s in real.steps])[i]) for i in real.finish_steps)
    other = serve_simulated(dataclasses.replace(e, max_num_seqs=2), trace, cost)  # admits fewer at once
    assert other.shapes != real.shapes
    assert compare(trace, real, real, same, cost, cfg.validation)["schedule"]["same_steps"]
    reordered = dataclasses.replace(same, shapes=same.shapes[::-1])  # as many steps, not the same ones
    assert not compare(trace, real, real, reordered, cost, cfg.validation)["schedule"]["same_steps"]
    section = compare(trace, real, real, other, cost, cfg.validation)
    assert not section["schedule"]["same_steps"]
    reasons = calibrate._validity({"validation": section})["reasons"]
    assert any("schedule differs" in r for r in reasons)


def _bad_config(tmp_path: Path, edit) -> Path:
    raw = yaml.safe_load(CONFIG.read_text())
    edit(raw)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize(("edit", "quick", "field", "problem"), [
    (lambda r: r["grid"].update(bogus=3), False, "grid.bogus", "unknown field"),
    (lambda r: r.update(extra={}), False, "extra", "unknown field"),
    (lambda r: r["grid"].update(steps_per_batch=-2), False, "grid.steps_per_batch", "expected an int >= 1, got -2"),
    (lambda r: r["grid"].update(prefill_lens=[16, -64]), False, "grid.prefill_lens", "ints >= 1"),
    (lambda r: r["validation"].update(length_scale=-0.5), False, "validation.length_scale", "number > 0"),
    (lambda r: r["engine"].pop("num_blocks"), False, "engine.num_blocks", "missing"),
    (lambda r: r["quick"]["grid"].update(steps_per_batch=0), True, "quick.grid.steps_per_batch", ">= 1, got 0"),
    (lambda r: r["grid"].update(decode_batches=[4, 8]), False, "grid.decode_batches", "decreasing"),
    (lambda r: r["engine"].update(num_blocks=8), False, "engine.num_blocks", "unpreempted"),
    (lambda r: r["grid"].update(spread_contexts=[16, 1000]), False, "grid.spread_contexts", "more than engine.max"),
    (lambda r: r["engine"].update(attention_backend="cuda"), False, "engine.attention_backend", "torch-batched"),
    (lambda r: r["grid"].update(join_batches=[4, 31]), False, "grid.join_batches", "exceeds engine.max_num_seqs"),
    (lambda r: r["grid"].update(join_prefill_lens=[3, 2000]), False, "grid.join_prefill_lens", "shorter than"),
    (lambda r: r["grid"].update(join_prefill_lens=list(range(1, 200))), False, "grid.join_prefill_lens",
     "a join run reaches"),
    (lambda r: r["grid"].update(after_prefill_lens=[64, 16]), False, "grid.after_prefill_lens", "increasing"),
    (lambda r: r["grid"].update(after_prefill_batches=[1, 1]), False, "grid.after_prefill_batches", "increasing"),
    (lambda r: r["grid"].update(after_prefill_stretch=8), False, "grid.after_prefill_stretch", "no steady state"),
    (lambda r: r["grid"].update(after_prefill_batches=[1, 32]), False, "grid.after_prefill_batches",
     "exceed engine.max_num_seqs"),
    (lambda r: r["grid"].update(after_prefill_repeats=200), False, "grid.after_prefill_stretch", "reaches"),
    (lambda r: r["grid"].update(after_prefill_context=1024), False, "grid.after_prefill_context", "shorter than"),
    (lambda r: r["engine"].update(model="models/no-such-model"), False, "engine.model", "nor a model folder"),
])
def test_bad_config_names_the_file_and_the_field(tmp_path, edit, quick, field, problem):
    path = _bad_config(tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(problem)) as info:
        load_config(path, quick=quick)
    assert isinstance(info.value, ProfileError) and info.value.field == field
    assert str(path) in str(info.value) and f"field {field!r}" in str(info.value)


def test_a_model_folder_is_read_from_its_config_json(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(hf))
    path = _bad_config(tmp_path, lambda r: r["engine"].update(model=str(folder)))
    assert load_config(path).engine.model == str(folder)
    path = _bad_config(tmp_path, lambda r: r["engine"].update(model=str(folder), max_model_len=2048))
    with pytest.raises(ProfileError, match=r"2048 exceeds model .* 1024"):  # the folder's own positions
        load_config(path)
    assert model_config(str(folder)).max_position_embeddings == 1024 and model_config("small").vocab_size > 0


def test_the_shipped_config_loads_both_ways():
    full, quick = load_config(), load_config(quick=True)
    assert full.engine.model == "small" and quick.engine.model == "tiny"
    assert quick.engine.block_size == full.engine.block_size  # fields quick does not set are kept


def test_atomic_write_keeps_the_old_file_when_the_replace_fails(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    write_atomic(path, "old")
    assert path.stat().st_mode & 0o777 == 0o644

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("pagedbench.bench.studies.calibrate.report.os.replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["calibration.json"]
    monkeypatch.undo()
    write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["calibration.json"]


def test_step_batch_counts_a_chunks_cached_context_without_the_chunk():
    shape = StepShape(((5, 5), (3, 8)), (6, 9))  # a whole prompt; a second chunk after 5 cached tokens
    assert step_batch(shape) == StepBatch.of(decode_context_lens=(6, 9), prefill_chunks=((5, 0), (3, 5)))


class _Flat:
    """A model that prices every step at 2 ms."""

    def step_time_s(self, batch) -> float:
        return 0.002


def _timed(kind: str, seconds: float) -> TimedStep:
    shape = {"decode": StepShape((), (5, 9)), "prefill": StepShape(((4, 4),), ()),
             "mixed": StepShape(((3, 3),), (7,))}[kind]
    return TimedStep(shape, seconds, seconds, seconds, 0.0)


def test_decode_errors_are_bucketed_by_the_decode_steps_since_a_prefill():
    run_a = [_timed("prefill", 0.009), _timed("decode", 0.004), _timed("decode", 0.002), _timed("mixed", 0.008),
             _timed("decode", 0.001), *[_timed("decode", 0.0025)] * 9]
    run_b = [_timed("decode", 0.001), _timed("decode", 0.001)]  # no prefill before them: far from one
    rows = {r["since_prefill"]: r for r in decode_errors_since_prefill(_Flat(), [run_a, run_b])}
    assert [r for r in rows] == ["1", "2", "3", "4-7", "8+"]
    assert rows["1"]["num_steps"] == 2  # right after the prefill, and right after the mixed step
    assert rows["1"]["median_signed"] == pytest.approx(((0.002 / 0.004 - 1) + (0.002 / 0.001 - 1)) / 2)
    assert rows["2"]["num_steps"] == 2 and rows["2"]["median_signed"] == pytest.approx((0.0 + 0.002 / 0.0025 - 1) / 2)
    assert rows["3"]["num_steps"] == 1 and rows["3"]["median_step_s"] == pytest.approx(0.0025)
    assert rows["4-7"]["num_steps"] == 4
    assert rows["8+"]["num_steps"] == 3 + 2  # run_a's 8th-10th step after the mixed one, and run_b's two
    assert sum(r["num_steps"] for r in rows.values()) == 14
