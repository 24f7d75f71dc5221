"""The step-time roofline: monotone in every kind of work, memory-bound decode at batch 1, compute-bound
large prefill, and checked batches."""

from __future__ import annotations

import timeit

import pytest
from pagedbench.bench.costmodel.hardware import load_hardware
from pagedbench.bench.costmodel.models import load_model
from pagedbench.bench.costmodel.step_cost import StepBatch, StepCostModel


@pytest.fixture(scope="module")
def model_and_cost():
    model, gpu = load_model("llama-2-13b"), load_hardware("a100-40gb")
    return model, gpu, StepCostModel.from_profiles(model, gpu)


def test_decode_at_batch_1_is_weights_over_bandwidth(model_and_cost):
    model, gpu, cost = model_and_cost
    t = cost.step_time_s(StepBatch.of(decode_context_lens=(1,)))
    weights_s = model.weight_bytes / gpu.achievable_bandwidth_bytes_per_s
    fixed_s = gpu.step_overhead_s + model.num_hidden_layers * gpu.layer_overhead_s
    # Memory-bound: streaming the weights once is the whole cost (the embedding table is not streamed:
    # only looked up, hence slightly under weight_bytes).
    assert t - fixed_s == pytest.approx(weights_s, rel=0.02)
    assert t - fixed_s > 2 * model.num_params * 1 / gpu.achievable_flops_per_s * 50


def test_large_prefill_is_compute_bound(model_and_cost):
    model, gpu, cost = model_and_cost
    t = cost.step_time_s(StepBatch.of(prefill_chunks=((4096, 0),)))
    linear_flops = 2 * model.num_hidden_layers * model.linear_params_per_layer * 4096
    linear_flops_s = linear_flops / gpu.achievable_flops_per_s
    assert t > linear_flops_s > model.weight_bytes / gpu.achievable_bandwidth_bytes_per_s


@pytest.mark.parametrize("grow", ["decode_seqs", "decode_context", "prefill_q", "prefill_ctx", "add_chunk"])
def test_more_work_is_never_faster(model_and_cost, grow):
    _, _, cost = model_and_cost
    for base_decode in [(), (1,), (17, 300), tuple(range(1, 257))]:
        for base_chunks in [(), ((1, 0),), ((512, 0), (97, 1024))]:
            if not base_decode and not base_chunks:
                continue
            before = cost.step_time_s(StepBatch.of(base_decode, base_chunks))
            decode, chunks = list(base_decode), list(base_chunks)
            if grow == "decode_seqs":
                decode.append(1)
            elif grow == "decode_context" and decode:
                decode[-1] += 64
            elif grow == "prefill_q" and chunks:
                chunks[0] = (chunks[0][0] + 1, chunks[0][1])
            elif grow == "prefill_ctx" and chunks:
                chunks[-1] = (chunks[-1][0], chunks[-1][1] + 1000)
            elif grow == "add_chunk":
                chunks.append((16, 0))
            after = cost.step_time_s(StepBatch.of(tuple(decode), tuple(chunks)))
            assert after >= before, (grow, base_decode[:3], base_chunks)


def test_prefill_attention_is_quadratic(model_and_cost):
    _, _, cost = model_and_cost
    # The attention part of a chunk alone (its linear part is the same token count either way).
    no_attention_s = cost.time_from_totals_s(1, 0, 0)
    t = {q: cost.time_from_totals_s(1, 0, 0, ((q, 0),)) - no_attention_s for q in (4096, 8192)}
    assert t[8192] / t[4096] == pytest.approx(4, rel=0.01)


def test_one_token_chunk_reads_its_context_like_a_decode(model_and_cost):
    # q=1 after ctx cached tokens is memory-bound on the same ctx+1 KV tokens as a decode step at ctx+1.
    _, _, cost = model_and_cost
    as_chunk = cost.time_from_totals_s(1, 1, 0, ((1, 100_000),))
    as_decode = cost.time_from_totals_s(1, 1, 100_001)
    assert as_chunk == pytest.approx(as_decode, rel=1e-9)


def test_chunked_prefill_pays_for_its_context(model_and_cost):
    _, _, cost = model_and_cost
    whole = cost.step_time_s(StepBatch.of(prefill_chunks=((2048, 0),)))
    second_half = cost.step_time_s(StepBatch.of(prefill_chunks=((1024, 1024),)))
    first_half = cost.step_time_s(StepBatch.of(prefill_chunks=((1024, 0),)))
    assert first_half < second_half < whole


def test_empty_step_costs_nothing(model_and_cost):
    assert model_and_cost[2].step_time_s(StepBatch.of()) == 0.0


def test_h100_is_faster_than_a100():
    model = load_model("llama-3.1-8b")
    batch = StepBatch.of(tuple([700] * 64), ((512, 0),))
    times = {g: StepCostModel.from_profiles(model, load_hardware(g)).step_time_s(batch)
             for g in ("a100-40gb", "a100-80gb", "h100-sxm", "h200")}
    assert times["h200"] <= times["h100-sxm"] < times["a100-80gb"] < times["a100-40gb"]


@pytest.mark.parametrize(("kwargs", "expect"), [
    ({"num_prefill_tokens": 10, "prefill_chunks": ((4, 0),)}, r"num_prefill_tokens=10 but the prefill"),
    ({"num_prefill_tokens": 0, "decode_context_lens": (5, 0)}, r"must be >= 1 \(the new token\), got 0"),
    ({"num_prefill_tokens": 0, "prefill_chunks": ((0, 3),)}, r"q_len >= 1, ctx_len >= 0, got \(0, 3\)"),
    ({"num_prefill_tokens": 4, "prefill_chunks": ((4, -1),)}, r"got \(4, -1\)"),
])
def test_bad_batch_is_refused(kwargs, expect):
    with pytest.raises(ValueError, match=expect):
        StepBatch(**kwargs)


def test_a_call_takes_microseconds(model_and_cost):
    # A serving simulator calls this once per step, millions of times: keep it to a few µs.
    cost = model_and_cost[2]
    batch = StepBatch.of(tuple(range(100, 356)), ((512, 0),))
    per_call_s = min(timeit.repeat(lambda: cost.step_time_s(batch), number=2000, repeat=3)) / 2000
    assert per_call_s < 50e-6  # generous for a loaded 2-core machine; ~4 µs measured


def test_command_line_report_lists_every_gpu(capsys):
    from pagedbench.bench.costmodel.__main__ import main

    main(["--model", "opt-13b"])
    out = capsys.readouterr().out
    assert "15,360 token slots" in out
    assert all(g in out for g in ("a100-40gb", "a100-80gb", "h100-sxm", "h200"))


def test_fp8_kv_cache_halves_the_kv_bytes_attention_streams(model_and_cost):
    """A prefill chunk reads half the KV bytes from an fp8 cache; a long decode step costs less."""
    model, gpu, fp16 = model_and_cost
    fp8 = StepCostModel.from_profiles(model, gpu, kv_cache_dtype="fp8_e4m3")
    assert fp8.prefill_attn_s_per_kv_token == pytest.approx(fp16.prefill_attn_s_per_kv_token / 2)
    batch = StepBatch.of(decode_context_lens=(4096,) * 32)
    assert fp8.step_time_s(batch) < fp16.step_time_s(batch)
    assert fp8.linear_weights_s == fp16.linear_weights_s  # the weights are not what changed
