"""How many KV token slots fit on one GPU, derived the way vLLM sizes its cache.

vLLM's start-up profiling (``determine_num_available_blocks``) runs one dummy forward pass of
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sampled sequences, takes the peak memory
(weights + activations), and gives the KV cache what is left of ``gpu_memory_utilization x total``::

    kv_slots = (gpu_memory_utilization * memory_bytes - weight_bytes - activation_reserve_bytes)
               // kv_bytes_per_token

We cannot run the dummy pass, so :func:`activation_reserve_bytes` estimates its peak from the shape.
For OPT-13B on an A100-40GB this gives ~15.4K slots, against the vLLM paper's 15.7K (800 KB a token).

Tensor parallelism over ``N`` GPUs (Megatron-style, as vLLM shards): each GPU holds ``1/N`` of the weights,
``1/N`` of the attention heads' and the MLP's activations, and the K/V of ``num_key_value_heads / N`` heads of
*every* token (a KV head is never split: with fewer KV heads than GPUs each is replicated, vLLM's rule), so
a token slot exists on every GPU and the slot count is one GPU's::

    kv_slots = (gpu_memory_utilization * memory_bytes - weight_bytes / N - activations per GPU)
               // (2 x layers x ceil(kv_heads / N) x head_dim x dtype bytes)

Stated assumptions: the weights split evenly (the replicated norms and biases are < 0.1% of them); the
residual stream is whole on every GPU; the profiling pass's sampled logits are gathered whole on one GPU,
the one whose peak sets the budget (vLLM's driver worker), so every GPU reserves them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedbench.bench.costmodel.hardware import HardwareProfile
from pagedbench.bench.costmodel.models import ModelProfile

#: vLLM's default share of device memory it may use.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
#: vLLM's profiling pass: max(2048, max_model_len) tokens (OPT's max_model_len is 2048) and 256 sequences.
DEFAULT_PROFILE_TOKENS = 2048
DEFAULT_PROFILE_SEQS = 256
#: fp32 logits for the sampled rows, plus the sampler's softmax and log-softmax copies of them.
_LOGITS_COPIES = 3
_FP32_BYTES = 4


def kv_heads_per_gpu(model: ModelProfile, tensor_parallel_size: int = 1) -> int:
    """KV heads each GPU holds at ``tensor_parallel_size``: split, or replicated when fewer than GPUs."""
    return -(-model.num_key_value_heads // tensor_parallel_size)


def check_tensor_parallel_size(model: ModelProfile, tensor_parallel_size: object) -> int:
    """``tensor_parallel_size`` if ``model`` can be sharded so (heads split evenly; KV heads split evenly
    or each replicated on a whole number of GPUs), else ValueError naming the numbers."""
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    kv = model.num_key_value_heads
    if model.num_attention_heads % tp or (kv % tp and tp % kv):
        raise ValueError(f"{model.name}: {model.num_attention_heads} attention heads and {kv} KV heads cannot be "
                         f"split over tensor_parallel_size={tp} GPUs (heads % tp == 0, and kv_heads % tp == 0 "
                         "or tp % kv_heads == 0)")
    return tp


def activation_reserve_bytes(model: ModelProfile, num_tokens: int = DEFAULT_PROFILE_TOKENS,
                             num_seqs: int = DEFAULT_PROFILE_SEQS, tensor_parallel_size: int = 1) -> int:
    """Estimated activation peak of vLLM's profiling pass on one GPU (bytes).

    Live at the peak inside one layer: the residual stream and the normed input (``2 x hidden``, whole on
    every GPU) and the larger of attention's (q, k, v outputs + attention output) and the MLP's (up output
    + activated output) per token, those a GPU's share of the heads and of the MLP under tensor
    parallelism; then fp32 logits of the sampled sequences and two same-sized sampler copies.
    """
    tp = check_tensor_parallel_size(model, tensor_parallel_size)
    q_out = model.num_attention_heads // tp * model.head_dim
    kv_out = kv_heads_per_gpu(model, tp) * model.head_dim
    up_out = (2 if model.gated_mlp else 1) * model.intermediate_size // tp
    attn_live = q_out + 2 * kv_out + q_out
    mlp_live = up_out + model.intermediate_size // tp
    per_token = (2 * model.hidden_size + max(attn_live, mlp_live)) * model.dtype_bytes
    logits = num_seqs * model.vocab_size * _FP32_BYTES * _LOGITS_COPIES
    return num_tokens * per_token + logits


@dataclass(frozen=True, slots=True)
class KvSlotBudget:
    """The KV-slot derivation for one (model, GPU), every term kept so it can be printed. At
    ``tensor_parallel_size`` N > 1 every byte term is one GPU's (its weight shard, activations, its KV
    heads' bytes of a token); the slot count is then the number of tokens every GPU holds a share of."""

    model: str
    hardware: str
    memory_bytes: int  # one GPU's
    gpu_memory_utilization: float
    weight_bytes: int  # one GPU's shard
    activation_reserve_bytes: int
    kv_bytes_per_token: int  # one GPU's share of a token's K and V
    tensor_parallel_size: int = 1

    @property
    def kv_cache_bytes(self) -> int:
        usable = int(self.gpu_memory_utilization * self.memory_bytes)
        return usable - self.weight_bytes - self.activation_reserve_bytes

    @property
    def num_slots(self) -> int:
        return max(0, self.kv_cache_bytes // self.kv_bytes_per_token)

    def lines(self) -> list[str]:
        """The derivation as text, one step a line (the studies print it)."""
        gib = 2**30
        tp = self.tensor_parallel_size
        per_gpu = f" per GPU, x {tp} GPUs tensor-parallel" if tp > 1 else ""
        return [
            f"KV slots for {self.model} on {self.hardware}" + (f" x {tp} (tp={tp})" if tp > 1 else "") + ":",
            f"  usable memory   {self.gpu_memory_utilization:.2f} x {self.memory_bytes / gib:.2f} GiB"
            f" = {self.gpu_memory_utilization * self.memory_bytes / gib:.2f} GiB"
            " (vLLM gpu_memory_utilization)",
            f"  - weights       {self.weight_bytes / gib:.2f} GiB" + (f" (1/{tp} of the model's)" if tp > 1 else ""),
            f"  - activations   {self.activation_reserve_bytes / gib:.2f} GiB"
            " (estimated peak of vLLM's profiling forward pass)",
            f"  = KV cache      {self.kv_cache_bytes / gib:.2f} GiB",
            f"  / per token     {self.kv_bytes_per_token / 1024:.0f} KiB"
            + (" (2 x layers x kv_heads x head_dim x dtype bytes)" if tp == 1 else
               f" (2 x layers x kv_heads/{tp} x head_dim x dtype bytes){per_gpu}"),
            f"  = {self.num_slots:,} token slots",
        ]


def kv_slot_budget(model: ModelProfile, hardware: HardwareProfile,
                   gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                   activation_bytes: int | None = None, kv_cache_dtype: str = "auto",
                   tensor_parallel_size: int = 1) -> KvSlotBudget:
    """The derivation of :class:`KvSlotBudget`; ``activation_bytes`` overrides the estimate (one GPU's);
    ``kv_cache_dtype="fp8_e4m3"`` counts one byte per K/V element (twice the slots of fp16 KV);
    ``tensor_parallel_size`` shards the model over that many GPUs of ``hardware`` (module docstring)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    tp = check_tensor_parallel_size(model, tensor_parallel_size)
    reserve = (activation_reserve_bytes(model, tensor_parallel_size=tp) if activation_bytes is None
               else activation_bytes)
    per_token = model.kv_bytes_per_token_as(kv_cache_dtype) // model.num_key_value_heads * kv_heads_per_gpu(model, tp)
    return KvSlotBudget(model.name, hardware.name, hardware.memory_bytes, gpu_memory_utilization,
                        -(-model.weight_bytes // tp), reserve, per_token, tp)
