"""Tensor parallelism in the step-cost model: tp=1 is today's cost to the bit, at tp=4 each GPU does a
quarter of the compute (by hand) plus exactly 2 x layers all-reduces priced from Vidur's measured table,
the table is interpolated log-log (by hand), and a tp the model or the GPU cannot run is refused."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math

import pytest
from pagedbench.bench.costmodel.all_reduce import (
    ALL_REDUCE_CSV,
    AllReduceDataError,
    AllReduceTable,
    load_all_reduce,
)
from pagedbench.bench.costmodel.hardware import HARDWARE_DIR, load_hardware
from pagedbench.bench.costmodel.models import load_model
from pagedbench.bench.costmodel.profile_fields import ProfileError
from pagedbench.bench.costmodel.rank_shard import rank_shard
from pagedbench.bench.costmodel.step_cost import StepBatch, StepCostModel, TensorParallelStepCost


def _csv_rows(network: str, num_workers: int) -> list[tuple[float, float]]:
    with ALL_REDUCE_CSV.open() as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return sorted((float(r["size_bytes"]), float(r["time_ms"]) * 1e-3) for r in rows
                      if r["network"] == network and int(r["num_workers"]) == num_workers)


@pytest.mark.parametrize("model_name, gpu_name", [("opt-13b", "a100-40gb"), ("llama-3-70b", "h100-sxm")])
def test_tp_1_is_todays_cost_exactly(model_name, gpu_name):
    model, gpu = load_model(model_name), load_hardware(gpu_name)
    cost = StepCostModel.from_profiles(model, gpu, tensor_parallel_size=1)
    assert type(cost) is StepCostModel and cost == StepCostModel.from_profiles(model, gpu)
    # today's formulas, by hand from the profiles (exact equality: not one bit may move)
    bw, flops, layers = gpu.achievable_bandwidth_bytes_per_s, gpu.achievable_flops_per_s, model.num_hidden_layers
    pair_flops = 4 * model.num_attention_heads * model.head_dim * layers
    assert cost.linear_weights_s == (layers * model.linear_params_per_layer + model.lm_head_params) * 2 / bw
    assert cost.linear_mem_s_per_token == layers * model.gemm_io_elements_per_token_per_layer * 2 / bw
    assert cost.linear_compute_s_per_token == 2 * layers * model.linear_params_per_layer / flops
    assert cost.lm_head_s_per_sampled_token == 2 * model.lm_head_params / flops
    assert cost.decode_attn_s_per_context_token == max(model.kv_bytes_per_token / bw, pair_flops / flops)
    assert cost.prefill_attn_s_per_kv_token == model.kv_bytes_per_token / bw
    assert cost.prefill_attn_s_per_pair == pair_flops / flops
    assert cost.fixed_s == gpu.step_overhead_s + layers * gpu.layer_overhead_s


@pytest.fixture(scope="module")
def opt_66b_tp4():
    model, gpu = load_model("opt-66b"), load_hardware("a100-40gb")
    return model, gpu, StepCostModel.from_profiles(model, gpu), StepCostModel.from_profiles(model, gpu,
                                                                                          tensor_parallel_size=4)


def test_tp_4_compute_is_a_quarter_by_hand(opt_66b_tp4):
    _, gpu, tp1, tp4 = opt_66b_tp4
    assert isinstance(tp4, TensorParallelStepCost) and tp4.tensor_parallel_size == 4
    bw, flops = gpu.achievable_bandwidth_bytes_per_s, gpu.achievable_flops_per_s
    # OPT-66B, per GPU at tp=4: 18 of 72 heads (2304 wide), 9216 of 36864 MLP columns, 12568 of 50272 vocab rows
    h, q, i, layers = 9216, 18 * 128, 9216, 64
    params = 4 * q * h + 2 * h * i + (3 * q) + (h + i + h)  # q,k,v,o + fc1,fc2; split qkv/fc1 biases, whole o/fc2
    assert tp4.linear_compute_s_per_token == 2 * layers * params / flops
    assert tp4.linear_weights_s == (layers * params + 12568 * h) * 2 / bw
    # the column splits read the whole input, the row splits write the whole output: not a quarter
    assert tp4.linear_mem_s_per_token == layers * ((h + 3 * q) + (q + h) + (h + i) + (i + h)) * 2 / bw
    # exact quarters: lm_head FLOPs, attention FLOPs per pair, KV bytes per token
    assert tp4.lm_head_s_per_sampled_token == pytest.approx(tp1.lm_head_s_per_sampled_token / 4, rel=1e-15)
    assert tp4.prefill_attn_s_per_pair == pytest.approx(tp1.prefill_attn_s_per_pair / 4, rel=1e-15)
    assert tp4.prefill_attn_s_per_kv_token == pytest.approx(tp1.prefill_attn_s_per_kv_token / 4, rel=1e-15)
    assert tp4.decode_attn_s_per_context_token == pytest.approx(tp1.decode_attn_s_per_context_token / 4, rel=1e-15)
    # the linear compute is a quarter but for the replicated row-split biases (2 x 9216 of 1.0e9 a layer)
    assert tp4.linear_compute_s_per_token == pytest.approx(tp1.linear_compute_s_per_token / 4, rel=1e-4)
    assert tp4.fixed_s == tp1.fixed_s  # every GPU launches every layer's kernels


def test_tp_4_step_adds_exactly_2_x_layers_all_reduces_from_the_table(opt_66b_tp4):
    model, _, _, tp4 = opt_66b_tp4
    batch = StepBatch.of((1000,) * 36, ((64, 300),))  # 100 tokens: 100 x 9216 x 2 = 1,843,200 bytes
    size = 100 * 9216 * 2
    rows = _csv_rows("a100_dgx", 4)
    (x0, y0), (x1, y1) = next((a, b) for a, b in itertools.pairwise(rows) if a[0] <= size < b[0])
    one_s = math.exp(math.log(y0) + (math.log(y1) - math.log(y0)) * math.log(size / x0) / math.log(x1 / x0))
    without = dataclasses.replace(tp4, num_all_reduces=0)
    assert tp4.step_time_s(batch) == pytest.approx(without.step_time_s(batch) + 2 * 64 * one_s, rel=1e-12)
    assert tp4.num_all_reduces == 2 * model.num_hidden_layers
    # the simulator's running-totals entry point prices the same all-reduces
    assert tp4.time_from_totals_s(100, 37, 36_000, ((64, 300),)) == tp4.step_time_s(batch)
    assert tp4.step_time_s(StepBatch.of()) == 0.0


def test_interpolation_between_two_rows_by_hand():
    table = load_all_reduce("h100_dgx", 8)
    rows = _csv_rows("h100_dgx", 8)
    assert table.sizes_bytes == tuple(s for s, _ in rows) and table.times_s == tuple(t for _, t in rows)
    (x0, y0), (x1, y1) = rows[10], rows[11]
    # at the geometric mean of two sizes log-log interpolation gives the geometric mean of their times
    assert table.time_s(math.sqrt(x0 * x1)) == pytest.approx(math.sqrt(y0 * y1), rel=1e-12)
    # a quarter of the way in log(size): y0^(3/4) y1^(1/4)
    assert table.time_s(x0 ** 0.75 * x1 ** 0.25) == pytest.approx(y0 ** 0.75 * y1 ** 0.25, rel=1e-12)
    assert table.time_s(x0) == pytest.approx(y0, rel=1e-12)
    # outside the table: the smallest size's latency below; the largest time scaled by size above
    assert table.time_s(rows[0][0] / 10) == rows[0][1]
    assert table.time_s(3 * rows[-1][0]) == pytest.approx(3 * rows[-1][1], rel=1e-12)


def test_table_rejects_unsorted_or_short_rows():
    with pytest.raises(ValueError, match="strictly ascending"):
        AllReduceTable("x", 2, (2.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match=">= 2"):
        AllReduceTable("x", 2, (1.0,), (1.0,))


@pytest.mark.parametrize("model_name, tp, message", [
    ("opt-66b", 5, r"72 attention heads and 72 KV heads cannot be split over tensor_parallel_size=5"),
    ("llama-3-70b", 3, r"64 attention heads and 8 KV heads cannot be split over tensor_parallel_size=3"),
    ("opt-66b", 0, r"tensor_parallel_size must be an int >= 1, got 0"),
    ("opt-66b", True, r"tensor_parallel_size must be an int >= 1, got True"),
])
def test_tp_the_model_cannot_split_is_refused(model_name, tp, message):
    with pytest.raises(ValueError, match=message):
        StepCostModel.from_profiles(load_model(model_name), load_hardware("a100-80gb"), tensor_parallel_size=tp)


def test_mlp_that_does_not_split_is_refused():
    odd = dataclasses.replace(load_model("llama-2-7b"), intermediate_size=11002)
    with pytest.raises(ValueError, match=r"intermediate_size=11002 cannot be split over tensor_parallel_size=4"):
        StepCostModel.from_profiles(odd, load_hardware("a100-80gb"), tensor_parallel_size=4)


@pytest.mark.parametrize("gpu_name, model_name, tp, message", [
    ("l4", "llama-3-8b", 2, r"l4 at tensor_parallel_size=2: no measured all-reduce for no all-reduce node type"),
    ("h200", "llama-3-70b", 4, r"h200 at tensor_parallel_size=4: .*all_reduce_network: none"),
    ("a100-80gb", "opt-175b", 16, r"no measured all-reduce for 'a100_dgx' at 16 GPUs .*a100_dgx x 8"),
])
def test_tp_without_all_reduce_data_is_refused(gpu_name, model_name, tp, message):
    with pytest.raises(AllReduceDataError, match=message):
        StepCostModel.from_profiles(load_model(model_name), load_hardware(gpu_name), tensor_parallel_size=tp)


def test_kv_heads_fewer_than_gpus_are_replicated():
    # Llama-3-70B has 8 KV heads: at tp=16 each GPU keeps one whole KV head (not half of one)
    model, gpu = load_model("llama-3-70b"), load_hardware("h100-sxm")
    tp8 = StepCostModel.from_profiles(model, gpu, tensor_parallel_size=8)
    with pytest.raises(AllReduceDataError):  # heads split, but 16 GPUs were never measured
        StepCostModel.from_profiles(model, gpu, tensor_parallel_size=16)
    assert rank_shard(model, 16).num_key_value_heads == 1 == rank_shard(model, 8).num_key_value_heads
    assert tp8.prefill_attn_s_per_kv_token == 2 * 80 * 1 * 128 * 2 / gpu.achievable_bandwidth_bytes_per_s


def test_a_bad_all_reduce_network_in_a_profile_is_refused(tmp_path):
    text = (HARDWARE_DIR / "a100-80gb.yaml").read_text()
    (tmp_path / "a100-80gb.yaml").write_text(text.replace("all_reduce_network: a100_dgx",
                                                          "all_reduce_network: a100_pcie"))
    with pytest.raises(ProfileError, match=r"all_reduce_network.*one of \['a100_dgx', 'h100_dgx', 'none'\]"):
        load_hardware("a100-80gb", tmp_path)


def test_more_gpus_less_time_for_a_large_prefill():
    # a 2048-token prompt of Llama-2-70B on H100: compute-bound, so sharding wins despite the all-reduces
    model, gpu = load_model("llama-2-70b"), load_hardware("h100-sxm")
    batch = StepBatch.of(prefill_chunks=((2048, 0),))
    times = [StepCostModel.from_profiles(model, gpu, tensor_parallel_size=tp).step_time_s(batch) for tp in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
