"""The profile's grouping: each op in one category by its name, the host what the ops leave of the wall
time, the gap table's shares adding up to the whole gap, and our attention region's ops counted as
attention (as vLLM's custom attention op is)."""

from __future__ import annotations

import pytest
from pagedbench.bench.environment import environment
from pagedbench.bench.studies.engine_vs_vllm import op_categories as oc
from pagedbench.bench.studies.engine_vs_vllm.profile_report import gap_rows, render
from pagedbench.bench.studies.engine_vs_vllm.step_profile import ATTENTION_REGION, op_table

NAMES = {
    "aten::addmm": "GEMM (linear layers, LM head)",
    "aten::mm": "GEMM (linear layers, LM head)",
    "aten::linear": "GEMM (linear layers, LM head)",
    "_C::onednn_mm": "GEMM (linear layers, LM head)",
    "_C::paged_attention_v1": "attention",
    "aten::scaled_dot_product_attention": "attention",
    f"{ATTENTION_REGION}/aten::index_select": "attention",
    "_C_cache_ops::reshape_and_cache": "KV write and gather",
    "aten::index_select": "KV write and gather",
    "_C::rms_norm": "norms, rotary, activations",
    "aten::silu": "norms, rotary, activations",
    "aten::argmax": "sampling",
    "aten::copy_": "tensor bookkeeping",
    "aten::add": "elementwise arithmetic",
    "aten::mul_": "elementwise arithmetic",
    "vendor::frobnicate": oc.OTHER,
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_op_falls_in_its_category(name):
    assert oc.category(name) == NAMES[name]


def _ops(**seconds):
    return [{"name": n, "self_cpu_s": s, "calls": 1} for n, s in seconds.items()]


def test_categories_and_host_sum_to_the_wall_time():
    ops = _ops(**{"aten::addmm": 0.5, "aten::argmax": 0.1, "vendor::frobnicate": 0.05, "aten::mm": 0.25})
    got = oc.by_category(ops, wall_s=1.2)
    assert got["seconds"]["GEMM (linear layers, LM head)"] == pytest.approx(0.75)
    assert got["seconds"][oc.HOST] == pytest.approx(1.2 - 0.9)
    assert sum(got["seconds"].values()) == pytest.approx(1.2)
    assert got["top_other"] == [("vendor::frobnicate", 0.05)]


def test_a_wall_time_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="wall_s"):
        oc.by_category([], wall_s=0.0)


def _row(engine, wall_s, tokens, **seconds):
    grouped = oc.by_category(_ops(**seconds), wall_s)
    return {"engine": engine, "status": "ok", "torch": "x", "threads": 2, "generated_tokens": tokens,
            "plain_wall_s": wall_s * 0.9, "profiled_wall_s": wall_s, "top_ops": _ops(**seconds), **grouped}


def test_the_gap_rows_give_each_category_its_share_of_the_whole_gap():
    ours = _row("pagedbench", 3.0, 100, **{"aten::addmm": 1.0, f"{ATTENTION_REGION}/aten::bmm": 1.5})
    theirs = _row("vllm-eager", 2.0, 100, **{"aten::addmm": 1.0, "_C::paged_attention_v1": 0.5})
    rows = {r[0]: r for r in gap_rows(ours, theirs)}
    assert rows["attention"][3] == pytest.approx(10.0)  # (1.5 - 0.5) s over 100 tokens, in ms
    assert rows["attention"][4] == pytest.approx(1.0)  # the whole 10 ms/token gap
    assert rows["GEMM (linear layers, LM head)"][3] == pytest.approx(0.0)
    assert sum(r[4] for r in rows.values()) == pytest.approx(1.0)


def test_the_page_has_the_table_when_both_ran_and_says_why_when_one_did_not():
    ours = _row("pagedbench", 3.0, 100, **{"aten::addmm": 1.0})
    theirs = _row("vllm-eager", 2.0, 100, **{"aten::addmm": 1.0})
    doc = {"environment": environment(), "load_average": {"before": [1, 1, 1], "after": [1, 1, 1]},
           "config": {"model": "m", "num_requests": 2, "max_tokens": 3, "dtype": "float32", "threads": 2},
           "engines": [ours, theirs]}
    text = render(doc)
    assert "| host (outside any op) |" in text and "+10.00" in text
    doc["engines"] = [ours, {"engine": "vllm-eager", "status": "not run", "reason": "no venv"}]
    text = render(doc)
    assert "vllm-eager: not run: no venv" in text and "No side-by-side table" in text


class _Event:
    def __init__(self, name, self_us, parent=None):
        self.name, self.self_cpu_time_total, self.cpu_parent = name, self_us, parent


def test_ops_under_our_attention_region_are_named_after_it():
    region = _Event(ATTENTION_REGION, 5.0)
    sdpa = _Event("aten::scaled_dot_product_attention", 100.0, region)
    inner = _Event("aten::index_select", 40.0, _Event("aten::something", 1.0, region))
    outside = _Event("aten::index_select", 30.0)
    table = {r["name"]: r for r in op_table([region, sdpa, inner, outside])}
    assert table[f"{ATTENTION_REGION}/aten::index_select"]["self_cpu_s"] == pytest.approx(40e-6)
    assert table["aten::index_select"]["self_cpu_s"] == pytest.approx(30e-6)
    assert oc.category(f"{ATTENTION_REGION}/aten::index_select") == "attention"


def test_the_linear_shapes_are_the_engines_fused_layers_and_both_gemm_paths_agree_with_float64():
    from pagedbench.bench.studies.engine_vs_vllm import gemm_paths

    config = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128}
    shapes = {name: (o, i) for name, o, i in gemm_paths.linear_shapes(config)}
    assert shapes == {"qkv": (4 * 16 + 2 * 2 * 16, 64), "o": (64, 64), "gate_up": (192, 64), "down": (64, 96),
                      "lm_head": (128, 64)}
    rows = gemm_paths.compare(config, token_counts=(3,), rounds=1, reps=1)
    if rows[0]["status"] != "ok":
        pytest.skip(rows[0]["reason"])
    assert len(rows) == 5
    for r in rows:  # float32 GEMMs of these sizes: within 1e-5 of the float64 product
        assert max(r["max_rel_error_vs_float64"].values()) < 1e-5 and r["ratio"] > 0
