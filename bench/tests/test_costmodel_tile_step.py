"""The step cost with ``linear="tile"``: the tile fit's layers x layers by hand, the tile step at 136 tokens,
a tensor-parallel shard's K/N by hand, the fallback fit of an unprofiled GPU, and the default roofline
unchanged to the bit (against a copy of the formula it had before)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from pagedbench.bench.costmodel import StepCostModel, TensorParallelStepCost, load_hardware, load_model
from pagedbench.bench.costmodel.tile_step_cost import (
    PROFILED_GPUS,
    TABLE_BLOCK,
    TensorParallelTileStepCost,
    TileStepCost,
    gpu_tile_fit,
)
from pagedbench.bench.costmodel.vidur_curves import load_curves


def _combine(a: float, b: float, p: float) -> float:
    return max(a, b) if math.isinf(p) else (a**p + b**p) ** (1 / p)


def _gemm_by_hand(g, k: int, n: int, t: int, gpu) -> float:
    """One GEMM [t, k] x [k, n] of the fit ``g``: weights and activations once; FLOPs of ceil(t / tile) tiles."""
    mem = (k * n + t * (k + n)) * 2 / gpu.hbm_bandwidth_bytes_per_s
    comp = 2 * k * n * g.tile_m * math.ceil(t / g.tile_m) / gpu.dense_flops_per_s
    return g.overhead_s + _combine(mem / g.bandwidth_fraction, comp / g.compute_fraction, g.p)


def _layer_by_hand(fit, shapes, elements: int, t: int, gpu) -> float:
    gemms = sum(_gemm_by_hand(g, k, n, t, gpu) for g, (k, n) in zip(fit.gemms, shapes))
    return gemms + fit.other_fixed_s + fit.other_s_per_element * t * elements


def test_tile_step_is_the_fits_layer_times_layers_plus_the_lm_head_by_hand():
    model, gpu = load_model("llama-2-7b"), load_hardware("a100-80gb")
    cost = StepCostModel.from_profiles(model, gpu, linear="tile")
    fit = gpu_tile_fit("a100-80gb")
    assert type(cost) is TileStepCost and cost.label == "llama-2-7b on a100-80gb, linear layers: tile fit of a100-80gb"
    assert cost.fixed_s == gpu.step_overhead_s  # the layer overhead is the fit's now
    counts = np.array([1, 100, 128, 136, 3000])
    linear = [cost.time_from_totals_s(int(t), 0, 0) - cost.fixed_s for t in counts]
    assert linear == pytest.approx(32 * fit.layer_time_s(model, gpu, counts), rel=1e-12)
    # T = 136 by hand: h = 4096, 32 heads of 128 (q = k = v = 4096), MLP 11008 gated
    shapes = [(4096, 3 * 4096), (4096, 4096), (4096, 2 * 11008), (11008, 4096)]
    elements = 4 * 4096 + 2 * (4096 + 4096) + 3 * 11008 + 3 * 4096
    assert linear[3] == pytest.approx(32 * _layer_by_hand(fit, shapes, elements, 136, gpu), rel=1e-12)
    # the lm_head: [S, 4096] x [4096, 32000] with the MLP-up GEMM's fit, S rows padded to its tile
    lm_head = cost.time_from_totals_s(136, 7, 0) - cost.time_from_totals_s(136, 0, 0)
    assert lm_head == pytest.approx(_gemm_by_hand(fit.gemms[2], 4096, 32000, 7, gpu), rel=1e-9)
    # the attention terms are the roofline's
    roof = StepCostModel.from_profiles(model, gpu)
    assert (cost.decode_attn_s_per_context_token, cost.prefill_attn_s_per_pair) == (
        roof.decode_attn_s_per_context_token, roof.prefill_attn_s_per_pair)
    with_attn = cost.time_from_totals_s(200, 9, 5000, ((64, 300), (8, 0)))
    attn = roof.time_from_totals_s(200, 9, 5000, ((64, 300), (8, 0))) - roof.time_from_totals_s(200, 9, 0)
    assert with_attn - cost.time_from_totals_s(200, 9, 0) == pytest.approx(attn, rel=1e-9)


def test_a_step_past_the_tile_costs_a_step_under_tile_and_not_under_the_roofline():
    model, gpu = load_model("llama-2-7b"), load_hardware("a100-80gb")
    for linear, jumps in (("tile", True), ("roofline", False)):
        cost = StepCostModel.from_profiles(model, gpu, linear=linear)
        t128, t136 = (cost.time_from_totals_s(t, t, t) for t in (128, 136))
        # an affine cost in T rises by less than T's own 136 / 128; the tile's padding adds 128 rows
        assert (t136 / t128 > 1.2) is jumps and (t136 / t128 > 136 / 128) is jumps, linear


def test_tensor_parallel_shards_each_gemms_k_and_n_by_hand():
    model, gpu = load_model("llama-2-70b"), load_hardware("a100-80gb")
    cost = StepCostModel.from_profiles(model, gpu, tensor_parallel_size=4, linear="tile")
    roof = StepCostModel.from_profiles(model, gpu, tensor_parallel_size=4)
    assert type(cost) is TensorParallelTileStepCost and isinstance(cost, TensorParallelStepCost)
    fit = gpu_tile_fit("a100-80gb")
    # per GPU: 64 / 4 = 16 query heads of 128 (2048), 8 / 4 = 2 KV heads (256 each for k and v), MLP 28672 / 4
    shapes = [(8192, 2048 + 2 * 256), (2048, 8192), (8192, 2 * 7168), (7168, 8192)]
    elements = 4 * 8192 + 2 * (2048 + 256) + 3 * 7168 + 3 * 8192
    t = 136
    by_hand = (80 * _layer_by_hand(fit, shapes, elements, t, gpu) + _gemm_by_hand(fit.gemms[2], 8192, 8000, 3, gpu)
               + roof.all_reduce_s(t))
    assert cost.time_from_totals_s(t, 3, 0) - cost.fixed_s == pytest.approx(by_hand, rel=1e-9)
    assert cost.all_reduce_s(t) == roof.all_reduce_s(t) > 0


def test_an_unprofiled_gpu_takes_the_nearest_profiled_fit_on_its_own_roofs():
    assert sorted({c.gpu for c in load_curves()}) == sorted(PROFILED_GPUS)
    model = load_model("llama-3.1-8b")
    for gpu_name, source in (("a100-40gb", "a100-80gb"), ("h200", "h100-sxm"), ("l4", "a100-80gb")):
        gpu = load_hardware(gpu_name)
        cost = StepCostModel.from_profiles(model, gpu, linear="tile")
        assert cost.linear_curve.fit is gpu_tile_fit(source) and cost.linear_curve.hardware == gpu
        assert cost.label.endswith(f"tile fit of {source} on {gpu_name}'s datasheet roofs (Vidur did not profile it)")
    # on its own roofs: H200's greater bandwidth makes its memory-bound steps cheaper than H100's
    h100, h200 = (StepCostModel.from_profiles(model, load_hardware(g), linear="tile") for g in ("h100-sxm", "h200"))
    assert h200.time_from_totals_s(8, 8, 0) < h100.time_from_totals_s(8, 8, 0)


def test_the_tables_do_not_depend_on_the_order_counts_are_asked_in():
    model, gpu = load_model("opt-13b"), load_hardware("a100-40gb")
    big_first, small_first = (StepCostModel.from_profiles(model, gpu, linear="tile") for _ in range(2))
    assert big_first.linear_curve is not small_first.linear_curve
    a = [big_first.time_from_totals_s(t, 1, 0) for t in (3 * TABLE_BLOCK + 5, 7, TABLE_BLOCK)]
    b = [small_first.time_from_totals_s(t, 1, 0) for t in (7, TABLE_BLOCK)]
    b.insert(0, small_first.time_from_totals_s(3 * TABLE_BLOCK + 5, 1, 0))
    assert a == b and len(big_first.linear_curve.tables(0)[0]) == 4 * TABLE_BLOCK
    assert dataclasses.asdict(big_first) == dataclasses.asdict(small_first)  # a point's key: the fields only


def test_bad_linear_or_counts_are_refused_naming_the_choices():
    model, gpu = load_model("llama-2-7b"), load_hardware("a100-80gb")
    with pytest.raises(ValueError, match="linear='tiles': expected one of 'roofline', 'tile'"):
        StepCostModel.from_profiles(model, gpu, linear="tiles")
    cost = StepCostModel.from_profiles(model, gpu, linear="tile")
    for tokens, sampled in ((4, 5), (-1, 0), (3, -1)):
        with pytest.raises(ValueError, match=f"num_tokens={tokens}, num_sampled={sampled}"):
            cost.time_from_totals_s(tokens, sampled, 0)
    assert cost.time_from_totals_s(0, 0, 0) == 0.0


def _old_time_from_totals_s(c, num_tokens, num_sampled, decode_context_tokens, prefill_chunks=()):
    """The roofline's formula as it was before the tile model, copied."""
    if num_tokens == 0:
        return 0.0
    memory_s = c.linear_weights_s + c.linear_mem_s_per_token * num_tokens
    compute_s = c.linear_compute_s_per_token * num_tokens + c.lm_head_s_per_sampled_token * num_sampled
    t = c.fixed_s + (memory_s if memory_s > compute_s else compute_s)
    t += c.decode_attn_s_per_context_token * decode_context_tokens
    for q, ctx in prefill_chunks:
        kv_s = c.prefill_attn_s_per_kv_token * (ctx + q)
        pair_s = c.prefill_attn_s_per_pair * q * (ctx + 0.5 * (q + 1))
        t += kv_s if kv_s > pair_s else pair_s
    if isinstance(c, TensorParallelStepCost):
        t += c.all_reduce_s(num_tokens)
    return t


@pytest.mark.parametrize("model_name,gpu_name,tp", [("opt-13b", "a100-40gb", 1), ("llama-3.1-8b", "h100-sxm", 1),
                                                    ("llama-2-70b", "a100-80gb", 4)])
def test_the_default_is_the_roofline_as_before_to_the_bit(model_name, gpu_name, tp):
    model, gpu = load_model(model_name), load_hardware(gpu_name)
    default = StepCostModel.from_profiles(model, gpu, tensor_parallel_size=tp)
    named = StepCostModel.from_profiles(model, gpu, tensor_parallel_size=tp, linear="roofline")
    assert default == named and type(default) in (StepCostModel, TensorParallelStepCost)
    assert "linear_curve" not in dataclasses.asdict(default)
    rng = np.random.default_rng(11)
    for _ in range(300):
        chunks = tuple((int(q), int(c)) for q, c in zip(rng.integers(1, 600, rng.integers(0, 3)),
                                                         rng.integers(0, 3000, 3)))
        decode = int(rng.integers(0, 256))
        args = (decode + sum(q for q, _ in chunks), decode + len(chunks), int(rng.integers(0, 400_000)), chunks)
        assert default.time_from_totals_s(*args) == _old_time_from_totals_s(default, *args)


def test_the_fit_error_reports_the_step_costs_linear_part():
    from pagedbench.bench.costmodel.fit_error import old_fit_s, step_linear_rows, tile_fit_s

    curves = [c for c in load_curves() if (c.gpu, c.model) in {("a100-80gb", "llama-2-7b"), ("h100-sxm", "phi-2")}]
    rows = step_linear_rows(curves)
    for curve, row in zip(curves, rows):
        assert (row["gpu"], row["model"]) == (curve.gpu, curve.model)
        # tile: the simulator's step is layers x the fit's layer, so its error is the in-sample fit's
        tile = tile_fit_s(gpu_tile_fit(curve.gpu), curve) / curve.layer_s - 1
        assert row["tile"]["max_abs_error"] == pytest.approx(np.abs(tile).max(), rel=1e-9)
        assert row["tile"]["num_points"] == len(curve.num_tokens)
        # roofline: the old fit's layer, plus the lm_head's weights its memory term streams (so never below)
        old = old_fit_s(curve) / curve.layer_s - 1
        assert old.mean() <= row["roofline"]["mean_error"] < old.mean() + 0.01
        assert row["tile"]["max_abs_error"] < row["roofline"]["max_abs_error"]
