"""A linear-layer model that follows the GEMMs' tile steps, fitted per GPU on every profiled token count.

cuBLAS computes a ``[T, K] x [K, N]`` GEMM in tiles of ``tile_m`` rows of tokens, so the work done is
that of ``tile_m x ceil(T / tile_m)`` tokens: the time steps up each time ``T`` passes a multiple of the
tile (on A100, +30-80% from 128 to 136 tokens), which a roofline in ``T`` itself under-predicts by up to
~40% just past each step. Each of a layer's four GEMMs (:data:`vidur_data.GEMM_OPS`: q/k/v, o, MLP up,
MLP down) gets::

    t(T) = overhead + ( (mem / bw_fraction)^p + (comp / compute_fraction)^p )^(1/p)
    mem  = (K*N + T*(K + N)) * dtype / peak bandwidth           weights once, inputs and outputs
    comp = 2 * K * N * tile_m * ceil(T / tile_m) / peak FLOP/s   the padded tiles' FLOPs

(``p = inf`` is the plain roofline max; a finite ``p`` rounds its knee, where neither roof binds alone).
The other operations of the layer (norms, rotary, activation, residual add) are memory-bound elementwise
work: ``fixed + s_per_element * T * elements per token``.

:func:`fit_gpu` fits, for one GPU, each GEMM's ``tile_m`` (64, 128 or 256), ``p`` (2, 3, 4, 8 or inf) and
the two fractions on a 0.02 grid, the overhead in closed form (>= 0), minimising the mean squared relative
error over every token count of every profiled model of that GPU; the other operations by non-negative
least squares on relative error. The fit knows only the shapes, so it applies to a model Vidur did not
profile (the fit-error report measures that by leaving each model out) and, through the datasheet
roofs, to another GPU (its held-out check: A100's fit on H100).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pagedbench.bench.costmodel.hardware import HardwareProfile, load_hardware
from pagedbench.bench.costmodel.models import ModelProfile, load_model
from pagedbench.bench.costmodel.rank_shard import rank_shard
from pagedbench.bench.costmodel.vidur_curves import LayerCurve

TILE_M_CHOICES = (64, 128, 256)
P_CHOICES = (2.0, 3.0, 4.0, 8.0, float("inf"))
BANDWIDTH_GRID = np.round(np.arange(0.40, 1.0 + 1e-9, 0.02), 2)
COMPUTE_GRID = np.round(np.arange(0.30, 1.0 + 1e-9, 0.02), 2)


@dataclass(frozen=True, slots=True)
class GemmFit:
    """One GEMM kind's fitted coefficients on one GPU (module docstring)."""

    tile_m: int
    p: float  # inf: max(mem, comp)
    bandwidth_fraction: float
    compute_fraction: float
    overhead_s: float

    def time_s(self, mem_s: np.ndarray, comp_padded_s: np.ndarray) -> np.ndarray:
        """Seconds from the undivided roofs (at 100% of the datasheet), ``comp`` already tile-padded."""
        return self.overhead_s + _combine(mem_s / self.bandwidth_fraction, comp_padded_s / self.compute_fraction,
                                          self.p)


@dataclass(frozen=True, slots=True)
class GpuTileFit:
    """The fit of one GPU: the four GEMMs (GEMM_OPS order) and the layer's other operations."""

    gpu: str
    gemms: tuple[GemmFit, GemmFit, GemmFit, GemmFit]
    other_fixed_s: float
    other_s_per_element: float  # per token x elementwise element (see elementwise_elements_per_token)

    def layer_time_s(self, model: ModelProfile, hardware: HardwareProfile, num_tokens: Sequence[int] | np.ndarray,
                     tensor_parallel_size: int = 1) -> np.ndarray:
        """Seconds of one layer outside attention at each token count, on ``hardware``'s datasheet roofs
        (one GPU's share at ``tensor_parallel_size``; its all-reduces are not included)."""
        t = np.asarray(num_tokens, dtype=np.float64)
        if t.size and t.min() < 1:
            raise ValueError(f"token counts must be >= 1, got {t.min():g}")
        total = self.other_fixed_s + self.other_s_per_element * t * elementwise_elements_per_token(
            model, tensor_parallel_size)
        for fit, (k, n) in zip(self.gemms, gemm_shapes(model, tensor_parallel_size)):
            mem, comp = gemm_roofs(k, n, t, fit.tile_m, model.dtype_bytes, hardware)
            total = total + fit.time_s(mem, comp)
        return total


def _combine(a: np.ndarray, b: np.ndarray, p: float) -> np.ndarray:
    if np.isinf(p):
        return np.maximum(a, b)
    return (a**p + b**p) ** (1.0 / p)


def gemm_shapes(model: ModelProfile, tensor_parallel_size: int = 1) -> list[tuple[int, int]]:
    """``(K, N)`` of the q/k/v, o, MLP-up and MLP-down GEMMs one GPU runs (columns or rows split over tp)."""
    s = rank_shard(model, tensor_parallel_size)
    h = model.hidden_size
    q, kv = s.num_attention_heads * model.head_dim, s.num_key_value_heads * model.head_dim
    up = (2 if model.gated_mlp else 1) * s.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, up), (s.intermediate_size, h)]


def elementwise_elements_per_token(model: ModelProfile, tensor_parallel_size: int = 1) -> int:
    """Elements the layer's non-GEMM operations read and write per token on one GPU: two norms (h in, h out
    each) and the residual add (2h in, h out) on the whole hidden width; rotary (q and k in and out) and
    the activation (up output in, intermediate out) on the GPU's heads and MLP columns."""
    s = rank_shard(model, tensor_parallel_size)
    h, i = model.hidden_size, s.intermediate_size
    q, kv = s.num_attention_heads * model.head_dim, s.num_key_value_heads * model.head_dim
    return 2 * 2 * h + 2 * (q + kv) + ((2 if model.gated_mlp else 1) * i + i) + 3 * h


def gemm_roofs(k: int, n: int, num_tokens: np.ndarray, tile_m: int, dtype_bytes: int,
               hardware: HardwareProfile) -> tuple[np.ndarray, np.ndarray]:
    """(memory seconds, tile-padded compute seconds) of a ``[T, k] x [k, n]`` GEMM at 100% of the datasheet."""
    mem = (k * n + num_tokens * (k + n)) * dtype_bytes / hardware.hbm_bandwidth_bytes_per_s
    comp = 2.0 * k * n * tile_m * np.ceil(num_tokens / tile_m) / hardware.dense_flops_per_s
    return mem, comp


def _fit_gemm(mem_by_tile: dict[int, np.ndarray], comp_by_tile: dict[int, np.ndarray],
              y: np.ndarray) -> GemmFit:
    """The grid point of least mean squared relative error, with its best overhead (>= 0)."""
    w2 = 1.0 / y**2
    best: tuple[float, GemmFit] | None = None
    for tile_m in mem_by_tile:
        mem = mem_by_tile[tile_m][None, None, :] / BANDWIDTH_GRID[:, None, None]
        comp = comp_by_tile[tile_m][None, None, :] / COMPUTE_GRID[None, :, None]
        for p in P_CHOICES:
            roof = _combine(mem, comp, p)  # [bw, compute, point]
            # d/do sum(((roof + o - y) / y)^2) = 0  ->  o = sum((y - roof) w2) / sum(w2)
            overhead = np.clip(((y - roof) * w2).sum(-1) / w2.sum(), 0.0, None)
            loss = (((roof + overhead[..., None] - y) / y) ** 2).mean(-1)
            i, j = np.unravel_index(int(loss.argmin()), loss.shape)
            if best is None or loss[i, j] < best[0]:
                best = (float(loss[i, j]), GemmFit(tile_m, p, float(BANDWIDTH_GRID[i]), float(COMPUTE_GRID[j]),
                                                   float(overhead[i, j])))
    assert best is not None
    return best[1]


def _fit_other(curves: Sequence[LayerCurve], models: dict[str, ModelProfile]) -> tuple[float, float]:
    y = np.concatenate([c.other_s for c in curves])
    x = np.concatenate([c.num_tokens * float(elementwise_elements_per_token(models[c.model])) for c in curves])
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    norms = np.linalg.norm(a, axis=0)
    coef, *_ = np.linalg.lstsq(a / norms, np.ones_like(y), rcond=None)
    coef = coef / norms
    if coef.min() < 0:  # a negative cost is unphysical: keep the better single term
        single = [np.array([np.sum(1 / y) / np.sum(1 / y**2), 0.0]),
                  np.array([0.0, np.sum(x / y) / np.sum(x**2 / y**2)])]
        coef = min(single, key=lambda c: np.mean(((c[0] + c[1] * x) / y - 1) ** 2))
    return float(coef[0]), float(coef[1])


def fit_gpu(curves: Sequence[LayerCurve], tile_m_choices: Sequence[int] = TILE_M_CHOICES) -> GpuTileFit:
    """The fit of the GPU of ``curves`` (all of one GPU) on every token count of every curve."""
    gpus = {c.gpu for c in curves}
    if len(gpus) != 1:
        raise ValueError(f"fit_gpu fits one GPU at a time, got curves of {sorted(gpus)}")
    hardware = load_hardware(gpus.pop())
    models = {c.model: load_model(c.model) for c in curves}
    gemms = []
    for j in range(4):
        mem_by_tile, comp_by_tile = {}, {}
        for tile_m in tile_m_choices:
            parts = [gemm_roofs(*gemm_shapes(models[c.model])[j], c.num_tokens.astype(np.float64), tile_m,
                                models[c.model].dtype_bytes, hardware) for c in curves]
            mem_by_tile[tile_m] = np.concatenate([m for m, _ in parts])
            comp_by_tile[tile_m] = np.concatenate([c for _, c in parts])
        gemms.append(_fit_gemm(mem_by_tile, comp_by_tile, np.concatenate([c.gemm_s[:, j] for c in curves])))
    fixed, per_element = _fit_other(curves, models)
    return GpuTileFit(hardware.name, tuple(gemms), fixed, per_element)
