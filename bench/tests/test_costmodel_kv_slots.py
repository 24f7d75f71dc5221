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


def test_opt_66b_at_tp_4_against_a_hand_computation():
    # OPT-66B (64 layers, hidden 9216, 72 heads of 128, ffn 36864, vocab 50272) over 4 A100-40GB: one GPU's
    # shard of the weights, its share of the activations, 18 of the 72 KV heads of every token
    model, gpu = load_model("opt-66b"), load_hardware("a100-40gb")
    budget = kv_slot_budget(model, gpu, tensor_parallel_size=4)
    weights = -(-model.num_params * 2 // 4)
    attn = 2 * (72 // 4) * 128 + 2 * (72 // 4) * 128  # q and attention output, k and v
    mlp = 36864 // 4 + 36864 // 4  # fc1 output and the activated copy
    activations = 2048 * (2 * 9216 + max(attn, mlp)) * 2 + 256 * 50272 * 4 * 3
    per_token = 2 * 64 * 18 * 128 * 2
    usable = int(0.9 * 40 * 2**30)
    assert (budget.weight_bytes, budget.activation_reserve_bytes, budget.kv_bytes_per_token) == (
        weights, activations, per_token)
    assert budget.num_slots == (usable - weights - activations) // per_token
    # the vLLM paper's Table 1 says 9.7K: derived, not tuned, so only near it
    assert budget.num_slots == pytest.approx(9_700, rel=0.1)
    assert "x 4 (tp=4)" in budget.lines()[0] and "1/4 of the model's" in "\n".join(budget.lines())


def test_opt_175b_at_tp_8_is_near_the_papers_table_1():
    budget = kv_slot_budget(load_model("opt-175b"), load_hardware("a100-80gb"), tensor_parallel_size=8)
    assert budget.num_slots == pytest.approx(60_100, rel=0.1)


def test_tp_1_is_the_unsharded_derivation_and_kv_heads_replicate_past_their_count():
    model, gpu = load_model("llama-3-70b"), load_hardware("h100-sxm")  # 8 KV heads of 64 attention heads
    one = kv_slot_budget(model, gpu)
    assert kv_slot_budget(model, gpu, tensor_parallel_size=1) == one
    # at tp=16 each of the 8 KV heads is held by two GPUs: a token's share is one head, not half of one
    sixteen = kv_slot_budget(model, gpu, tensor_parallel_size=16)
    assert sixteen.kv_bytes_per_token == one.kv_bytes_per_token // 8


@pytest.mark.parametrize(("model", "tp", "match"), [
    ("opt-66b", 5, "72 attention heads and 72 KV heads cannot be split over tensor_parallel_size=5"),
    ("llama-3-70b", 3, "64 attention heads and 8 KV heads cannot be split over tensor_parallel_size=3"),
    ("opt-13b", 0, "tensor_parallel_size must be an int >= 1, got 0"),
    ("opt-13b", 2.0, "tensor_parallel_size must be an int >= 1, got 2.0"),
])
def test_a_tp_the_heads_do_not_divide_is_refused(model, tp, match):
    with pytest.raises(ValueError, match=match):
        kv_slot_budget(load_model(model), load_hardware("a100-80gb"), tensor_parallel_size=tp)
