"""Vidur's per-layer times at every profiled token count (``bench/data/vidur/mlp_tp1_all_tokens.csv``).

One :class:`LayerCurve` per (GPU, model): the four GEMMs' and the other operations' median times of one
layer outside attention, at each of the ~259 token counts Vidur profiled at tensor-parallel degree 1
(:mod:`pagedbench.bench.costmodel.vidur_extract` ``--all-tokens`` wrote the file). Unlike
:mod:`pagedbench.bench.costmodel.vidur_data`'s ten counts, these show the GEMMs' tile steps (a step of
+30-80% each time the token count passes a multiple of 128 on A100).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pagedbench.bench.costmodel.vidur_data import GEMM_OPS

ALL_TOKENS_CSV = Path(__file__).resolve().parent.parent / "data" / "vidur" / "mlp_tp1_all_tokens.csv"


@dataclass(frozen=True, slots=True, eq=False)
class LayerCurve:
    """One layer of ``model`` on ``gpu``: ``gemm_s[k, j]`` is GEMM ``GEMM_OPS[j]`` at ``num_tokens[k]``."""

    gpu: str
    model: str
    num_tokens: np.ndarray  # [n] int64, ascending
    gemm_s: np.ndarray  # [n, 4] float64 seconds, GEMM_OPS order
    other_s: np.ndarray  # [n] float64 seconds: norms, rotary, activation, residual add

    @property
    def layer_s(self) -> np.ndarray:
        """[n] seconds of the whole layer outside attention (the four GEMMs and the other operations)."""
        return self.gemm_s.sum(axis=1) + self.other_s


def load_curves(path: Path = ALL_TOKENS_CSV) -> list[LayerCurve]:
    """Every (GPU, model) of the file, sorted by GPU then model."""
    with path.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["gpu"], r["model"]), []).append(r)
    curves = []
    for (gpu, model), rs in sorted(groups.items()):
        rs.sort(key=lambda r: int(r["num_tokens"]))
        curves.append(LayerCurve(
            gpu, model, np.array([int(r["num_tokens"]) for r in rs], dtype=np.int64),
            np.array([[float(r[f"{op}_ms"]) for op in GEMM_OPS] for r in rs]) * 1e-3,
            np.array([float(r["other_ms"]) for r in rs]) * 1e-3))
    return curves


#: token rows per GEMM tile at which a profiled curve may step (cuBLAS row tiles are multiples of 64)
TILE_STEP_TOKENS = 64


def step_interpolate(xs: np.ndarray, ys: np.ndarray, x: float, step: int | None = TILE_STEP_TOKENS) -> float:
    """``ys`` at ``x`` from a profile measured at ascending ``xs``, following its tile steps.

    With ``a <= x <= b`` the profiled counts around ``x``: linear between them when all three lie in the
    same ``step``-token tile (``ceil(. / step)`` equal); else the value of the one in ``x``'s tile (a GEMM's
    time stays level within a tile and jumps between tiles, so interpolating across a boundary would put
    half the jump at the wrong counts); linear again when neither shares it. Below the first count: its
    value; above the last: the last value scaled by ``x / xs[-1]`` (compute-bound there). ``step=None``:
    plain linear interpolation between the two.
    """
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1] * x / xs[-1])
    i = int(np.searchsorted(xs, x))  # xs[i - 1] < x <= xs[i]
    if xs[i] == x:
        return float(ys[i])
    a, b = xs[i - 1], xs[i]
    if step is not None:
        ta, tx, tb = -(-a // step), -(-x // step), -(-b // step)
        if tx == tb and tx != ta:
            return float(ys[i])
        if tx == ta and tx != tb:
            return float(ys[i - 1])
    return float(ys[i - 1] + (x - a) / (b - a) * (ys[i] - ys[i - 1]))
