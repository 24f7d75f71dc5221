"""The throughput study's harness on a tiny model: traces, records, the cross-run check and the report."""

from __future__ import annotations

import json

import pytest
from pagedbench.bench.common.environment import environment
from pagedbench.bench.studies.throughput.report import write_markdown, write_plot
from pagedbench.bench.studies.throughput.study import Run, study_workload
from pagedbench.bench.workloads.token_traces import Workload, make_trace
from pagedbench.refengine import load_model

CFG = dict(section="cpu", model="tiny-test", attention_backend="torch", block_size=4, kv_budget_slots=96,
           max_model_len=32, max_num_seqs=16, max_num_batched_tokens=64, seed=0, torch_threads_used=1)


@pytest.fixture(scope="module")
def loaded():
    return load_model(dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64),
                      attention_backend="torch", seed=0)


def test_make_trace_scales_and_fits():
    w = Workload("s", "sharegpt", 0.125, 50, system_prompt_len=5)
    t = make_trace(w, vocab_size=64, max_model_len=32, seed=0)
    assert len(t.prompts) == 50 and all(p[:5] == t.prompts[0][:5] for p in t.prompts)
    assert all(len(p) + o <= 32 and o >= 1 for p, o in zip(t.prompts, t.output_lens))
    assert t == make_trace(w, vocab_size=64, max_model_len=32, seed=0)  # seeded


def test_records_and_report(loaded, tmp_path):
    alloc = study_workload(loaded, CFG, Workload("a", "alpaca", 0.25, 8),
                           [Run("paged", False), Run("contiguous", False)])
    prefix = study_workload(loaded, CFG, Workload("p", "alpaca", 0.25, 6, system_prompt_len=9),
                            [Run("paged", True), Run("paged", False)])
    parallel = study_workload(loaded, CFG, Workload("n", "alpaca", 0.25, 4),
                              [Run("paged", False, n, sampled=True) for n in (1, 2)])
    records = alloc + prefix + parallel
    assert all(r["validity"]["valid"] for r in records)
    paged, contiguous = (r["figures"] for r in alloc)
    assert paged["num_generated_tokens"] == contiguous["num_generated_tokens"] > 0
    assert contiguous["peak_running_seqs"] <= 3  # 24 blocks of 4 hold 3 reservations of 32 slots
    on, off = (r["figures"] for r in prefix)
    assert on["prefix_hit_rate"] > 0 and on["sharing_saving"] > 0 and off["prefix_hit_rate"] == 0
    one, two = (r["figures"]["num_generated_tokens"] for r in parallel)
    assert two == 2 * one
    cfg = dict(CFG, workloads=[{"name": "a"}], prefix_sharing={"name": "p"}, parallel_sampling={"name": "n"})
    result = {"study": "throughput", "environment": environment(), "config": cfg, "records": records}
    json.dumps(result)  # records are plain data
    text = write_markdown(result, tmp_path / "t.md")
    assert "| a " in text and "## Prefix sharing" in text and "## Parallel sampling" in text
    write_plot(result, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
    from pagedbench.bench.studies.throughput.study import main

    (tmp_path / "throughput.json").write_text(json.dumps(result))
    main(["--render-only", "--out", str(tmp_path)])  # the page again from the record, nothing run
    assert (tmp_path / "throughput.md").read_text() == text


def test_paged_over_contiguous_per_model_against_the_aim():
    from pagedbench.bench.studies.throughput.report import paged_over_contiguous

    def rec(model, name, allocator, tps):
        return {"model": model, "workload": {"name": name}, "implementation": {"allocator": allocator},
                "figures": {"generated_tokens_per_s": tps}}

    out = paged_over_contiguous([
        rec("small", "sharegpt", "paged", 240.0), rec("small", "sharegpt", "contiguous", 100.0),
        rec("smollm2", "sharegpt", "paged", 150.0), rec("smollm2", "sharegpt", "contiguous", 100.0),
        rec("smollm2", "alpaca", "paged", 1.0)])
    assert [(v["model"], v["workload"], v["verdict"]) for v in out] == [
        ("small", "sharegpt", "met"), ("smollm2", "sharegpt", "not met")]
    assert out[0]["ratio"] == pytest.approx(2.4) and out[1]["ratio"] == pytest.approx(1.5)


def test_smollm2_status_says_what_to_do(tmp_path):
    from pagedbench.bench.studies.throughput.study import smollm2_status

    cfg = {"section": "cpu", "smollm2": {"folder": str(tmp_path / "missing")}}
    assert "make model" in smollm2_status(cfg, True)
    cfg["smollm2"]["folder"] = str(tmp_path)
    assert "--with-smollm2" in smollm2_status(cfg, False)
    assert smollm2_status(cfg, True) == "run"
    assert smollm2_status({"section": "gpu"}, True).startswith("skipped")


def test_every_run_reports_its_host_share_of_step(loaded):
    records = study_workload(loaded, CFG, Workload("a", "alpaca", 0.25, 4), [Run("paged", False)])
    share = records[0]["figures"]["host_share_of_step"]
    assert 0.0 < share < 1.0
    assert "forward" not in vars(loaded.model) and "compute_logits" not in vars(loaded.model)  # restored


TINY_TP = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


def test_tensor_parallel_rows_alternate_sizes_and_check_tokens(tmp_path):
    from pagedbench.bench.common.environment import environment
    from pagedbench.bench.studies.throughput.report import tensor_parallel_section
    from pagedbench.bench.studies.throughput.tensor_parallel import study_tensor_parallel
    from pagedbench.refengine import ModelConfig

    model_cfg = ModelConfig.from_dict(TINY_TP)
    cfg = dict(CFG, dtype="float32", torch_threads=1)
    records = study_tensor_parallel(model_cfg, cfg, Workload("t", "alpaca", 0.25, 6), [1, 2], 1, "tiny-test")
    one, two = records
    assert [r["implementation"]["tensor_parallel_size"] for r in records] == [1, 2]
    assert one["validity"]["valid"] and two["validity"]["valid"]  # greedy tokens equal request by request
    f1, f2 = one["figures"], two["figures"]
    assert f1["num_generated_tokens"] == f2["num_generated_tokens"] > 0 and f1["num_steps"] == f2["num_steps"]
    assert f1["num_all_reduces"] == 0 and f1["all_reduce_share_of_step"] == 0
    # rank 0 all-reduces twice per layer per step (attention out and MLP down projections)
    assert f2["all_reduces_per_step"] == 2 * TINY_TP["num_hidden_layers"]
    assert 0 < f2["all_reduce_share_of_step"] < f2["model_share_of_step"] <= 1
    text = "\n".join(tensor_parallel_section({"tensor_parallel": {"environment": environment(), "records": records}}))
    assert "rank 0 all-reduce share" in text and "tp=2 / tp=1 generated tokens/s" in text
    assert "all-reduces per step" in text
