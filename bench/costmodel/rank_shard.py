"""One GPU's share of a model under Megatron-style tensor parallelism, as the step-cost roofline needs it.

Over ``tp`` GPUs each layer's q, k, v projections and the MLP's up (and gate) projection are split by
columns (each GPU computes ``1/tp`` of the heads and of the intermediate width, from the whole input),
and the o projection and the MLP's down projection by rows (each GPU reads its slice of the input and
writes a partial sum of the whole hidden width, summed across GPUs by an all-reduce)::

    x [T, h] --QKV cols--> [T, (q + 2 kv)/tp] --attn--> [T, q/tp] --o rows--> [T, h] partial -> all-reduce
    x [T, h] --up cols---> [T, up/tp] --act--> [T, i/tp] --down rows--> [T, h] partial -> all-reduce

So a GPU streams ``1/tp`` of the weights, does ``1/tp`` of the linear and attention FLOPs, and reads the
K/V of its ``kv_heads / tp`` heads; but its GEMMs still read the whole hidden-width input of the column
splits and write the whole hidden-width output of the row splits. A KV head is never split: with fewer KV
heads than GPUs each is replicated (vLLM's rule, as in :mod:`pagedbench.bench.costmodel.kv_slots`).
The lm_head is split by vocabulary rows (vLLM pads the vocabulary to a multiple of ``tp``: the ceiling).
At ``tp = 1`` every count is the model's own, in the same integers, so costs built from it are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedbench.bench.costmodel.kv_slots import check_tensor_parallel_size, kv_heads_per_gpu
from pagedbench.bench.costmodel.models import _TRAITS, ModelProfile


@dataclass(frozen=True, slots=True)
class RankShard:
    """What one of ``tensor_parallel_size`` GPUs holds and computes per layer (element counts)."""

    tensor_parallel_size: int
    num_attention_heads: int  # query heads on this GPU
    num_key_value_heads: int  # KV heads on this GPU (replicated when the model has fewer than GPUs)
    intermediate_size: int  # this GPU's columns of the MLP (per branch)
    linear_params_per_layer: int  # weights and biases this GPU's GEMMs stream
    lm_head_params: int  # this GPU's rows of the output projection
    gemm_io_elements_per_token_per_layer: int  # activations this GPU's GEMMs read and write per token
    kv_bytes_per_token: int  # K and V of this GPU's KV heads, every layer, one token


def rank_shard(model: ModelProfile, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto") -> RankShard:
    """One GPU's share of ``model`` at ``tensor_parallel_size`` (ValueError if it cannot be split so)."""
    tp = check_tensor_parallel_size(model, tensor_parallel_size)
    if model.intermediate_size % tp:
        raise ValueError(f"{model.name}: intermediate_size={model.intermediate_size} cannot be split over "
                         f"tensor_parallel_size={tp} GPUs (intermediate_size % tp == 0)")
    t = _TRAITS[model.architecture]
    h, i = model.hidden_size, model.intermediate_size // tp
    heads, kv_heads = model.num_attention_heads // tp, kv_heads_per_gpu(model, tp)
    q_out, kv_out = heads * model.head_dim, kv_heads * model.head_dim
    attn = h * (q_out + 2 * kv_out) + q_out * h
    mlp = (3 if t.gated_mlp else 2) * h * i
    # column-split biases are split; a row-split bias is added once to the whole output, on every GPU
    bias = (q_out + 2 * kv_out) * t.qkv_bias + (h + i + h) * t.other_linear_bias
    up_out = (2 if t.gated_mlp else 1) * i
    io = (h + q_out + 2 * kv_out) + (q_out + h) + (h + up_out) + (i + h)
    vocab = -(-model.vocab_size // tp)
    lm_head = vocab * h + vocab * t.lm_head_bias
    kv_bytes = model.kv_bytes_per_token_as(kv_cache_dtype) // model.num_key_value_heads * kv_heads
    return RankShard(tp, heads, kv_heads, i, attn + mlp + bias, lm_head, io, kv_bytes)
