"""How many KV token slots fit on one GPU, derived the way vLLM sizes its cache.

vLLM's start-up profiling (``determine_num_available_blocks``) runs one dummy forward pass of
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sampled sequences, takes the peak memory
(weights + activations), and gives the KV cache what is left of ``gpu_memory_utilization x total``::

    kv_slots = (gpu_memory_utilization * memory_bytes - weight_bytes - activation_reserve_bytes)
               // kv_bytes_per_token

We cannot run the dummy pass, so :func:`activation_reserve_bytes` estimates its peak from the shape.
For OPT-13B on an A100-40GB this gives ~15.4K slots, against the vLLM paper's 15.7K (800 KB a token).
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


def activation_reserve_bytes(model: ModelProfile, num_tokens: int = DEFAULT_PROFILE_TOKENS,
                             num_seqs: int = DEFAULT_PROFILE_SEQS) -> int:
    """Estimated activation peak of vLLM's profiling pass (bytes).

    Live at the peak inside one layer: the residual stream and the normed input (``2 x hidden``) and the
    larger of attention's (q, k, v outputs + attention output) and the MLP's (up output + activated
    output) per token; then fp32 logits of the sampled sequences and two same-sized sampler copies.
    """
    q_out = model.num_attention_heads * model.head_dim
    kv_out = model.num_key_value_heads * model.head_dim
    up_out = (2 if model.gated_mlp else 1) * model.intermediate_size
    attn_live = q_out + 2 * kv_out + q_out
    mlp_live = up_out + model.intermediate_size
    per_token = (2 * model.hidden_size + max(attn_live, mlp_live)) * model.dtype_bytes
    logits = num_seqs * model.vocab_size * _FP32_BYTES * _LOGITS_COPIES
    return num_tokens * per_token + logits


@dataclass(frozen=True, slots=True)
class KvSlotBudget:
    """The KV-slot derivation for one (model, GPU), every term kept so it can be printed."""

    model: str
    hardware: str
    memory_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int
    activation_reserve_bytes: int
    kv_bytes_per_token: int

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
        return [
            f"KV slots for {self.model} on {self.hardware}:",
            f"  usable memory   {self.gpu_memory_utilization:.2f} x {self.memory_bytes / gib:.2f} GiB"
            f" = {self.gpu_memory_utilization * self.memory_bytes / gib:.2f} GiB"
            " (vLLM gpu_memory_utilization)",
            f"  - weights       {self.weight_bytes / gib:.2f} GiB",
            f"  - activations   {self.activation_reserve_bytes / gib:.2f} GiB"
            " (estimated peak of vLLM's profiling forward pass)",
            f"  = KV cache      {self.kv_cache_bytes / gib:.2f} GiB",
            f"  / per token     {self.kv_bytes_per_token / 1024:.0f} KiB"
            " (2 x layers x kv_heads x head_dim x dtype bytes)",
            f"  = {self.num_slots:,} token slots",
        ]


def kv_slot_budget(model: ModelProfile, hardware: HardwareProfile,
                   gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                   activation_bytes: int | None = None, kv_cache_dtype: str = "auto") -> KvSlotBudget:
    """The derivation of :class:`KvSlotBudget`; ``activation_bytes`` overrides the estimate;
    ``kv_cache_dtype="fp8_e4m3"`` counts one byte per K/V element (twice the slots of fp16 KV)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    reserve = activation_reserve_bytes(model) if activation_bytes is None else activation_bytes
    return KvSlotBudget(model.name, hardware.name, hardware.memory_bytes, gpu_memory_utilization,
                        model.weight_bytes, reserve, model.kv_bytes_per_token_as(kv_cache_dtype))
