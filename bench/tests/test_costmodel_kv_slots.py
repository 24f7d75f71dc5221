"""KV slots from memory: OPT-13B on one A100-40GB must land near the vLLM paper's 15.7K slots."""

from __future__ import annotations

import pytest
from pagedbench.bench.costmodel.hardware import load_hardware
from pagedbench.bench.costmodel.kv_slots import activation_reserve_bytes, kv_slot_budget
from pagedbench.bench.costmodel.models import load_model

PAPER_SLOTS_OPT_13B_A100_40GB = 15_700  # Kwon et al., SOSP 2023, §3 (800 KB per token)


def test_opt_13b_on_a100_40gb_is_near_the_paper():
    # Assumptions: vLLM's default gpu_memory_utilization 0.9; activation reserve = estimated peak of its
    # profiling pass (2048 tokens, 256 sampled sequences); the 40 GiB datasheet memory.
    budget = kv_slot_budget(load_model("opt-13b"), load_hardware("a100-40gb"))
    assert budget.gpu_memory_utilization == 0.9
    assert budget.kv_bytes_per_token == 800 * 1024
    assert budget.num_slots == pytest.approx(PAPER_SLOTS_OPT_13B_A100_40GB, rel=0.05)


def test_derivation_lines_show_each_term():
    budget = kv_slot_budget(load_model("opt-13b"), load_hardware("a100-40gb"))
    text = "\n".join(budget.lines())
    assert "0.90 x 40.00 GiB" in text and "800 KiB" in text and f"{budget.num_slots:,} token slots" in text
    assert budget.num_slots == budget.kv_cache_bytes // budget.kv_bytes_per_token


def test_activation_reserve_opt_13b_is_a_few_hundred_mb():
    # 2048 x (2 x 5120 + 2 x 20480) x 2 bytes + 256 x 50272 x 4 bytes x 3 = 364 MB.
    assert activation_reserve_bytes(load_model("opt-13b")) == 2048 * 51200 * 2 + 256 * 50272 * 4 * 3


def test_more_utilization_more_slots_and_bad_utilization_refused():
    model, gpu = load_model("llama-2-13b"), load_hardware("a100-80gb")
    assert kv_slot_budget(model, gpu, 0.95).num_slots > kv_slot_budget(model, gpu, 0.9).num_slots
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.2"):
        kv_slot_budget(model, gpu, 1.2)


def test_model_too_big_gives_zero_slots_not_negative():
    assert kv_slot_budget(load_model("llama-2-70b"), load_hardware("a100-80gb")).num_slots == 0


def test_fp8_kv_cache_counts_one_byte_per_element():
    """fp8 KV (as LLM(kv_cache_dtype="fp8_e4m3") stores it) halves the bytes of an fp16 model's token,
    so about twice the slots fit in the same memory; an unknown name is refused."""
    model, gpu = load_model("opt-13b"), load_hardware("a100-40gb")
    fp16, fp8 = kv_slot_budget(model, gpu), kv_slot_budget(model, gpu, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_bytes_per_token * 2 == fp16.kv_bytes_per_token == 800 * 1024
    assert fp8.num_slots == fp8.kv_cache_bytes // (400 * 1024) and fp8.num_slots >= 2 * fp16.num_slots
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3; got 'fp8'"):
        kv_slot_budget(model, gpu, kv_cache_dtype="fp8")
