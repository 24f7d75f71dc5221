"""The time of one serving step on a GPU, as a roofline per component.

A step runs ``T`` tokens (prefill chunks plus one token per decode sequence) through every layer and
samples ``S`` of them (one per decode sequence and per prefill chunk). Each component costs the larger
of its memory time and its compute time, at the achievable (derated) roofs::

    time = fixed                                           step overhead + layers x layer overhead
         + max(W + m*T,  c*T + h*S)                        linear layers: weights W streamed once,
                                                           activations m per token; 2 x params FLOPs
         + a * sum(decode context lengths)                 decode attention: KV bytes (memory-bound)
         + sum over prefill chunks (q, ctx) of
             max(p_kv * (ctx + q),  p_pair * q * (ctx + (q + 1) / 2))
                                                           prefill attention: KV read vs causal QK/PV

``StepCostModel`` holds only these coefficients (precomputed from a model and a GPU profile, or fitted
by :func:`pagedbench.bench.costmodel.calibration.fit_profile`), so :meth:`StepCostModel.step_time_s` is a few
arithmetic operations per step plus one per prefill chunk: a serving simulator can call it millions of
times. An empty step costs nothing.

Linear layers (``from_profiles(..., linear=...)``): ``"roofline"`` (the default) is the ``max(...)`` above;
``"tile"`` replaces it, and the per-layer overhead, by the tile fit of the GPU's GEMMs on every token
count Vidur profiled, which follows the time's steps at each multiple of the GEMMs' row tile
(:mod:`pagedbench.bench.costmodel.tile_step_cost`: a table look-up per step).

Tensor parallelism (``from_profiles(..., tensor_parallel_size=N)``): the coefficients become one GPU's
share (:mod:`pagedbench.bench.costmodel.rank_shard`) and :class:`TensorParallelStepCost` adds
``+ 2 x layers x all_reduce(T x hidden x dtype bytes)`` from measured all-reduce times.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedbench.bench.costmodel.all_reduce import AllReduceDataError, interpolate_log_log, load_all_reduce
from pagedbench.bench.costmodel.hardware import HardwareProfile
from pagedbench.bench.costmodel.models import ModelProfile
from pagedbench.bench.costmodel.rank_shard import rank_shard

#: how ``from_profiles`` may price the linear layers (module docstring)
LINEAR_MODELS = ("roofline", "tile")
#: Megatron-style tensor parallelism sums partial outputs twice a layer: after o_proj and after the MLP's down
ALL_REDUCES_PER_LAYER = 2


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step's work.

    ``decode_context_lens[i]``: tokens decode sequence ``i`` attends to, its new token included.
    ``prefill_chunks[j] = (q_len, ctx_len)``: a prefill chunk of ``q_len`` new tokens whose sequence
    already has ``ctx_len`` tokens cached (0 for a whole prompt; > 0 for a later chunk or a prefix hit).
    ``num_prefill_tokens`` is the sum of the ``q_len`` (checked): use :meth:`of` to have it computed.
    """

    num_prefill_tokens: int
    decode_context_lens: tuple[int, ...] = ()
    prefill_chunks: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        q_total = sum(q for q, _ in self.prefill_chunks)
        if q_total != self.num_prefill_tokens:
            raise ValueError(f"num_prefill_tokens={self.num_prefill_tokens} but the prefill chunks hold "
                             f"{q_total} tokens")
        if self.decode_context_lens and min(self.decode_context_lens) < 1:
            raise ValueError(f"decode context lengths must be >= 1 (the new token), got "
                             f"{min(self.decode_context_lens)}")
        for q, ctx in self.prefill_chunks:
            if q < 1 or ctx < 0:
                raise ValueError(f"prefill chunk (q_len, ctx_len) must have q_len >= 1, ctx_len >= 0, "
                                 f"got ({q}, {ctx})")

    @classmethod
    def of(cls, decode_context_lens: tuple[int, ...] = (),
           prefill_chunks: tuple[tuple[int, int], ...] = ()) -> StepBatch:
        return cls(sum(q for q, _ in prefill_chunks), tuple(decode_context_lens), tuple(prefill_chunks))

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decode_context_lens)


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Coefficients of the step-time roofline (see the module docstring); all in seconds."""

    label: str  # where the coefficients came from ("llama-2-7b on a100-80gb", "fit: 40 CPU samples")
    fixed_s: float  # per non-empty step: step overhead + layers x layer overhead
    linear_weights_s: float  # W: streaming every weight once (lm_head included)
    linear_mem_s_per_token: float  # m: GEMM input/output activations of one token
    linear_compute_s_per_token: float  # c: 2 x layer params FLOPs of one token
    lm_head_s_per_sampled_token: float  # h: 2 x vocab x hidden FLOPs of one sampled token
    decode_attn_s_per_context_token: float  # a: max(KV bytes, QK/PV FLOPs) of one context token
    prefill_attn_s_per_kv_token: float  # p_kv: KV bytes of one token a prefill chunk reads
    prefill_attn_s_per_pair: float  # p_pair: QK + PV FLOPs of one (query, key) pair

    @classmethod
    def from_profiles(cls, model: ModelProfile, hardware: HardwareProfile,
                      kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1, *,
                      linear: str = "roofline") -> StepCostModel:
        """The roofline of ``model`` on ``hardware`` at its achievable fractions; attention streams KV
        stored as ``kv_cache_dtype`` (``ModelProfile.kv_bytes_per_token_as``).

        At ``tensor_parallel_size`` N > 1 the model is sharded over N such GPUs
        (:mod:`pagedbench.bench.costmodel.rank_shard`): every coefficient is one GPU's share, and the
        returned :class:`TensorParallelStepCost` adds two all-reduces per layer priced from the measured
        table of the hardware's ``all_reduce_network`` (:mod:`pagedbench.bench.costmodel.all_reduce`).
        ValueError if the heads, KV heads or MLP do not split over N, or no all-reduce was measured for
        that GPU at N GPUs.

        ``linear``: one of :data:`LINEAR_MODELS`; ``"tile"`` returns the same model with its linear
        layers on the GPU's tile fit (:func:`pagedbench.bench.costmodel.tile_step_cost.with_tile_linear`:
        a :class:`TileStepCost` or :class:`TensorParallelTileStepCost`, whose label names the fit)."""
        if linear not in LINEAR_MODELS:
            raise ValueError(f"linear={linear!r}: expected one of {', '.join(map(repr, LINEAR_MODELS))}")
        shard = rank_shard(model, tensor_parallel_size, kv_cache_dtype)
        tp = shard.tensor_parallel_size
        bw = hardware.achievable_bandwidth_bytes_per_s
        flops = hardware.achievable_flops_per_s
        layers, dtype = model.num_hidden_layers, model.dtype_bytes
        linear_params = layers * shard.linear_params_per_layer
        q_width = shard.num_attention_heads * model.head_dim
        attn_flops_per_pair = 4 * q_width * layers  # QK^T and PV: 2 FLOPs per multiply-add, per head dim
        kv_bytes = shard.kv_bytes_per_token
        coefficients = dict(
            label=f"{model.name} on {hardware.name}" + (f" x {tp} (tp={tp})" if tp > 1 else ""),
            fixed_s=hardware.step_overhead_s + layers * hardware.layer_overhead_s,
            linear_weights_s=(linear_params + shard.lm_head_params) * dtype / bw,
            linear_mem_s_per_token=layers * shard.gemm_io_elements_per_token_per_layer * dtype / bw,
            linear_compute_s_per_token=2 * linear_params / flops,
            lm_head_s_per_sampled_token=2 * shard.lm_head_params / flops,
            decode_attn_s_per_context_token=max(kv_bytes / bw, attn_flops_per_pair / flops),
            prefill_attn_s_per_kv_token=kv_bytes / bw,
            prefill_attn_s_per_pair=attn_flops_per_pair / flops,
        )
        if tp == 1:
            cost = StepCostModel(**coefficients)
        else:
            cost = cls._tensor_parallel(coefficients, hardware, tp, layers, model.hidden_size * dtype)
        if linear == "tile":  # imported here: that module builds on this one's classes
            from pagedbench.bench.costmodel.tile_step_cost import with_tile_linear

            return with_tile_linear(cost, model, hardware)
        return cost

    @staticmethod
    def _tensor_parallel(coefficients: dict, hardware: HardwareProfile, tp: int, layers: int,
                         bytes_per_token: int) -> TensorParallelStepCost:
        try:
            table = load_all_reduce(hardware.all_reduce_network, tp)
        except AllReduceDataError as e:
            raise AllReduceDataError(f"{hardware.name} at tensor_parallel_size={tp}: {e}") from None
        return TensorParallelStepCost(
            **coefficients, tensor_parallel_size=tp, num_all_reduces=ALL_REDUCES_PER_LAYER * layers,
            all_reduce_bytes_per_token=bytes_per_token, all_reduce_sizes_bytes=table.sizes_bytes,
            all_reduce_times_s=table.times_s)

    def step_time_s(self, batch: StepBatch) -> float:
        """Seconds for ``batch``; 0.0 for an empty one."""
        num_decode = len(batch.decode_context_lens)
        return self.time_from_totals_s(batch.num_prefill_tokens + num_decode,
                                       num_decode + len(batch.prefill_chunks),
                                       sum(batch.decode_context_lens), batch.prefill_chunks)

    def time_from_totals_s(self, num_tokens: int, num_sampled: int, decode_context_tokens: int,
                           prefill_chunks: tuple[tuple[int, int], ...] = ()) -> float:
        """:meth:`step_time_s` from running totals, for a simulator that keeps them itself.

        ``num_sampled``: decode sequences plus prefill chunks; ``decode_context_tokens``: the sum of the
        decode context lengths.
        """
        if num_tokens == 0:
            return 0.0
        memory_s = self.linear_weights_s + self.linear_mem_s_per_token * num_tokens
        compute_s = (self.linear_compute_s_per_token * num_tokens
                     + self.lm_head_s_per_sampled_token * num_sampled)
        t = self.fixed_s + (memory_s if memory_s > compute_s else compute_s)
        t += self.decode_attn_s_per_context_token * decode_context_tokens
        per_kv, per_pair = self.prefill_attn_s_per_kv_token, self.prefill_attn_s_per_pair
        for q, ctx in prefill_chunks:
            kv_s = per_kv * (ctx + q)
            pair_s = per_pair * q * (ctx + 0.5 * (q + 1))
            t += kv_s if kv_s > pair_s else pair_s
        return t


@dataclass(frozen=True, slots=True)
class TensorParallelStepCost(StepCostModel):
    """:class:`StepCostModel` of one GPU of a tensor-parallel group, plus its all-reduces.

    A non-empty step adds ``num_all_reduces`` all-reduces of ``num_tokens x all_reduce_bytes_per_token``
    bytes each, priced by log-log interpolation in the measured ``(all_reduce_sizes_bytes,
    all_reduce_times_s)`` rows (:func:`pagedbench.bench.costmodel.all_reduce.interpolate_log_log`). Not
    counted (as in Vidur): the vocabulary-parallel embedding's all-reduce and the logits' gather.
    """

    tensor_parallel_size: int
    num_all_reduces: int  # per step: ALL_REDUCES_PER_LAYER x layers
    all_reduce_bytes_per_token: int  # hidden_size x dtype bytes: one token's residual stream
    all_reduce_sizes_bytes: tuple[float, ...]  # the measured table's rows, ascending
    all_reduce_times_s: tuple[float, ...]

    def all_reduce_s(self, num_tokens: int) -> float:
        """Seconds of the step's all-reduces for ``num_tokens`` tokens (0 for none)."""
        if num_tokens == 0:
            return 0.0
        size = num_tokens * self.all_reduce_bytes_per_token
        return self.num_all_reduces * interpolate_log_log(self.all_reduce_sizes_bytes, self.all_reduce_times_s, size)

    def time_from_totals_s(self, num_tokens: int, num_sampled: int, decode_context_tokens: int,
                           prefill_chunks: tuple[tuple[int, int], ...] = ()) -> float:
        # a slotted dataclass is a new class, so zero-argument super() would not find it: name the base
        compute_s = StepCostModel.time_from_totals_s(self, num_tokens, num_sampled, decode_context_tokens,
                                                     prefill_chunks)
        return compute_s + self.all_reduce_s(num_tokens)
