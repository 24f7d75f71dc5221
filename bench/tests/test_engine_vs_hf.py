"""The engine-vs-transformers bench's bookkeeping: static batches and the tokens they count, verdicts,
and the SmolLM2 case's skip line."""

from __future__ import annotations

import json

from pagedbench.bench.common.environment import environment
from pagedbench.bench.studies.engine_vs_hf import study as engine_vs_hf
from pagedbench.bench.studies.engine_vs_hf.report import markdown


def test_verdict_is_met_at_the_goal_and_not_below():
    assert engine_vs_hf.verdict(1.0, 1.0) == "met"
    assert engine_vs_hf.verdict(1.6, 1.5) == "met"
    assert engine_vs_hf.verdict(0.99, 1.0) == "not met"


def test_a_static_batch_generates_up_to_its_longest_request():
    assert engine_vs_hf.static_batches([3, 1, 5, 2, 4], 2) == [(0, 2, 3), (2, 4, 5), (4, 5, 4)]


def test_output_lengths_equal_and_sharegpt_like():
    cases = {c.name: c for c in engine_vs_hf.CASES}
    assert engine_vs_hf.output_lengths(cases["small-equal"], 64, 0) == [64] * engine_vs_hf.BATCH
    varied = engine_vs_hf.output_lengths(cases["small-sharegpt"], 64, 0)
    assert len(varied) == 3 * engine_vs_hf.BATCH  # more requests than seats: finished seats get refilled
    assert len(set(varied)) > 10 and min(varied) >= 1 and max(varied) <= 128
    assert varied == engine_vs_hf.output_lengths(cases["small-sharegpt"], 64, 0)  # seeded


def test_smollm2_without_its_folder_is_a_skip_line(tmp_path, monkeypatch):
    missing = tmp_path / "no-model"
    case = engine_vs_hf.Case("smollm2-equal", str(missing), 32, "equal", 1.0, 2)
    monkeypatch.setattr(engine_vs_hf, "SMOLLM2_DIR", missing)
    monkeypatch.setattr(engine_vs_hf, "CASES", (case,))
    engine_vs_hf.main(["--case", "smollm2-equal", "--with-smollm2", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "engine_vs_hf.json").read_text())
    (r,) = doc["results"]
    assert r["status"] == "skipped" and "make model" in r["reason"] and "ratio" not in r
    assert "make model" in (tmp_path / "engine_vs_hf.md").read_text()


def test_the_report_gives_each_ratio_against_its_goal():
    def ok(name, ratio, goal, verdict):
        run = {"generated_tokens_per_s": 10.0, "wall_s": 1.0, "num_steps": 3, "mean_step_ms": 1.0,
               "host_share_of_step": 0.25, "generated_tokens": 10, "padded_tokens": 12}
        return {"case": {"name": name, "model": "small", "goal": goal}, "status": "ok",
                "workload": {"num_requests": 32, "prompt_len": 8, "mean_output_len": 4.0},
                "engine": run, "transformers": run, "ratio": ratio, "verdict": verdict,
                "correctness": {"equal_request_share": 1.0}}

    doc = {"environment": environment(),
           "config": {"dtype": "float32", "batch": 32, "num_threads": 1, "repetitions": 2},
           "results": [ok("small-equal", 1.25, 1.0, "met"), ok("small-sharegpt", 1.2, 1.5, "not met")]}
    text = markdown(doc)
    assert "| small-equal | small |" in text and "**1.25** | ≥ 1 | met | 25.0% |" in text
    assert "**1.20** | ≥ 1.5 | not met |" in text
