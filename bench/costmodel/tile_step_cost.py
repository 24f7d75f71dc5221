"""The step-cost model with its linear layers priced along the GEMMs' tile steps (``linear="tile"``).

:class:`pagedbench.bench.costmodel.step_cost.StepCostModel` prices a step's linear layers as one roofline
in the token count ``T``, ``max(W + m*T, c*T + h*S)``; between multiples of the GEMMs' row tile that
under-predicts by up to ~40% (``results/costmodel_fit.md``). Here that term is replaced by::

    layers x layer(T)                 the tile fit's one layer outside attention at T tokens
                                      (:meth:`GpuTileFit.layer_time_s`: four GEMMs tile-padded, each with
                                      its fitted overhead, and the norms, rotary, activation, residual add)
  + lm_head(S)                        the output projection ``[S, h] x [h, vocab / tp]`` of the S sampled
                                      rows, priced the same way with the MLP-up GEMM's fitted coefficients
                                      (the same K = hidden; Vidur did not profile the lm_head)

and ``fixed_s`` keeps only the step overhead: the roofline's per-layer overhead is what the tile fit's
overheads now stand for. The attention terms and (at ``tensor_parallel_size`` > 1) the all-reduces are
the roofline's, unchanged; at tp > 1 the GEMMs are one GPU's shard (:func:`tile_fit.gemm_shapes`). The
roofline's linear coefficients are set to 0 on this model, so its fields say what it prices.

Which fit: the GPU's own where Vidur profiled it (:data:`PROFILED_GPUS`, fitted on every token count of
every profiled model, ``bench/data/vidur/mlp_tp1_all_tokens.csv``); for another GPU, the fit of the
profiled GPU nearest in dense FLOP/s (log scale; the tile behaviour is the tensor cores') applied to this
GPU's own datasheet roofs, as the fit-error report's held-out GPU check does (A100's fit on H100); the
model's ``label`` names which. A fit takes a few seconds and is made once per process per GPU.

Speed: ``layers x layer(T)`` and ``lm_head(S)`` are tabulated per count, in fixed blocks of
:data:`TABLE_BLOCK` counts grown as larger steps are asked for (a table's values never depend on the order
counts were asked in), so a step costs two list look-ups plus the attention terms.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
from pagedbench.bench.costmodel.hardware import HardwareProfile, load_hardware
from pagedbench.bench.costmodel.models import ModelProfile
from pagedbench.bench.costmodel.step_cost import StepCostModel, TensorParallelStepCost
from pagedbench.bench.costmodel.tile_fit import GpuTileFit, fit_gpu, gemm_roofs
from pagedbench.bench.costmodel.vidur_curves import ALL_TOKENS_CSV, load_curves

TABLE_BLOCK = 1024  # counts tabulated at a time
LM_HEAD_GEMM = 2  # the lm_head borrows this GEMM's fit (GEMM_OPS: MLP up, K = hidden like the lm_head's)
PROFILED_GPUS = ("a100-80gb", "h100-sxm")  # the GPUs of ALL_TOKENS_CSV (a test checks the file agrees)


@functools.cache
def gpu_tile_fit(gpu: str) -> GpuTileFit:
    """The tile fit of a profiled ``gpu`` on every token count of every model Vidur profiled on it."""
    if gpu not in PROFILED_GPUS:
        raise ValueError(f"no Vidur profile of {gpu!r} to fit; profiled: {', '.join(PROFILED_GPUS)}")
    return fit_gpu([c for c in load_curves(ALL_TOKENS_CSV) if c.gpu == gpu])


def fit_source_gpu(hardware: HardwareProfile) -> str:
    """The profiled GPU whose fit prices ``hardware``: itself, else the nearest in dense FLOP/s (log)."""
    if hardware.name in PROFILED_GPUS:
        return hardware.name
    return min(PROFILED_GPUS, key=lambda g: abs(math.log(load_hardware(g).dense_flops_per_s
                                                         / hardware.dense_flops_per_s)))


@dataclass(frozen=True)  # not slotted: the tables are a memo in __dict__, outside the fields
class TileLinearCurve:
    """One GPU's linear layers per step as a function of the step's token and sampled counts.

    Its fields decide every value (they are what ``dataclasses.asdict`` of the cost model shows and a
    cached serving point is keyed by); :meth:`tables` returns ``(by_tokens, by_sampled)``, Python lists
    of seconds with ``by_tokens[T] = layers x layer(T)`` (``[0] = 0``) and ``by_sampled[S] = lm_head(S)``
    (``[0] = 0``), both at least ``size`` long.
    """

    fit: GpuTileFit
    model: ModelProfile
    hardware: HardwareProfile  # whose datasheet roofs the fit's fractions apply to
    tensor_parallel_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_tokens", [])
        object.__setattr__(self, "_by_sampled", [])

    def linear_s(self, num_tokens: np.ndarray) -> np.ndarray:
        """``layers x layer(T)`` at each count (>= 1): what ``by_tokens`` holds."""
        layer = self.fit.layer_time_s(self.model, self.hardware, num_tokens, self.tensor_parallel_size)
        return self.model.num_hidden_layers * layer

    def lm_head_s(self, num_sampled: np.ndarray) -> np.ndarray:
        """The lm_head GEMM of ``S`` sampled rows (0 at S = 0): what ``by_sampled`` holds."""
        s = np.asarray(num_sampled, dtype=np.float64)
        g = self.fit.gemms[LM_HEAD_GEMM]
        vocab = -(-self.model.vocab_size // self.tensor_parallel_size)  # vLLM pads the vocabulary to tp
        mem, comp = gemm_roofs(self.model.hidden_size, vocab, s, g.tile_m, self.model.dtype_bytes, self.hardware)
        return np.where(s > 0, g.time_s(mem, comp), 0.0)

    def tables(self, size: int) -> tuple[list[float], list[float]]:
        by_tokens, by_sampled = self.__dict__["_by_tokens"], self.__dict__["_by_sampled"]
        while len(by_tokens) < size:
            start = len(by_tokens)
            counts = np.arange(max(start, 1), start + TABLE_BLOCK, dtype=np.float64)
            head = [0.0] if start == 0 else []
            by_tokens.extend(head + self.linear_s(counts).tolist())
            by_sampled.extend(head + self.lm_head_s(counts).tolist())
        return by_tokens, by_sampled


def _tile_time_s(cost, num_tokens: int, num_sampled: int, decode_context_tokens: int,
                 prefill_chunks: tuple[tuple[int, int], ...]) -> float:
    """StepCostModel.time_from_totals_s with the linear roofline replaced by the curve's two look-ups."""
    if not 0 <= num_sampled <= num_tokens:
        raise ValueError(f"a step samples 0..num_tokens rows: num_tokens={num_tokens}, num_sampled={num_sampled}")
    if num_tokens == 0:
        return 0.0
    curve = cost.linear_curve
    by_tokens, by_sampled = curve._by_tokens, curve._by_sampled
    if num_tokens >= len(by_tokens):
        by_tokens, by_sampled = curve.tables(num_tokens + 1)
    t = cost.fixed_s + by_tokens[num_tokens] + by_sampled[num_sampled]
    t += cost.decode_attn_s_per_context_token * decode_context_tokens
    per_kv, per_pair = cost.prefill_attn_s_per_kv_token, cost.prefill_attn_s_per_pair
    for q, ctx in prefill_chunks:
        kv_s = per_kv * (ctx + q)
        pair_s = per_pair * q * (ctx + 0.5 * (q + 1))
        t += kv_s if kv_s > pair_s else pair_s
    return t


@dataclass(frozen=True, slots=True)
class TileStepCost(StepCostModel):
    """:class:`StepCostModel` whose linear layers follow the tile fit (module docstring)."""

    linear_curve: TileLinearCurve

    def time_from_totals_s(self, num_tokens: int, num_sampled: int, decode_context_tokens: int,
                           prefill_chunks: tuple[tuple[int, int], ...] = ()) -> float:
        return _tile_time_s(self, num_tokens, num_sampled, decode_context_tokens, prefill_chunks)


@dataclass(frozen=True, slots=True)
class TensorParallelTileStepCost(TensorParallelStepCost):
    """:class:`TileStepCost` of one GPU of a tensor-parallel group, plus the roofline's all-reduces."""

    linear_curve: TileLinearCurve

    def time_from_totals_s(self, num_tokens: int, num_sampled: int, decode_context_tokens: int,
                           prefill_chunks: tuple[tuple[int, int], ...] = ()) -> float:
        return (_tile_time_s(self, num_tokens, num_sampled, decode_context_tokens, prefill_chunks)
                + self.all_reduce_s(num_tokens))


def with_tile_linear(roofline: StepCostModel, model: ModelProfile, hardware: HardwareProfile) -> StepCostModel:
    """``roofline`` (from :meth:`StepCostModel.from_profiles`) with its linear layers on the tile fit."""
    tp = getattr(roofline, "tensor_parallel_size", 1)
    source = fit_source_gpu(hardware)
    curve = TileLinearCurve(gpu_tile_fit(source), model, hardware, tp)
    fields = {f.name: getattr(roofline, f.name) for f in dataclasses.fields(roofline)}
    on = f"tile fit of {source}" + (f" on {hardware.name}'s datasheet roofs (Vidur did not profile it)"
                                    if source != hardware.name else "")
    fields.update(label=f"{roofline.label}, linear layers: {on}", fixed_s=hardware.step_overhead_s,
                  linear_weights_s=0.0, linear_mem_s_per_token=0.0, linear_compute_s_per_token=0.0,
                  lm_head_s_per_sampled_token=0.0, linear_curve=curve)
    cls = TensorParallelTileStepCost if isinstance(roofline, TensorParallelStepCost) else TileStepCost
    return cls(**fields)
