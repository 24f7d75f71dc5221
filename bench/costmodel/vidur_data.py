"""Vidur's measured per-layer times (``bench/data/vidur/mlp_tp1.csv``) and what the roofline needs of them.

Each :class:`LayerTimePoint` is one layer of one model on one GPU at one token count: its measured time
outside attention (the sum of Vidur's nine per-layer operations: four GEMMs, norms, rotary, activation,
residual add) beside the layer's roofline terms at the datasheet roofs, so a fit only rescales them.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from pagedbench.bench.costmodel.hardware import HardwareProfile, load_hardware
from pagedbench.bench.costmodel.models import ModelProfile, load_model

VIDUR_CSV = Path(__file__).resolve().parent.parent / "data" / "vidur" / "mlp_tp1.csv"
#: one layer's operations outside attention, as Vidur names them (each a column ``<op>_ms``)
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


@dataclass(frozen=True, slots=True)
class LayerTimePoint:
    """One measured layer and its roofline terms without derating (seconds at 100% of the datasheet roofs)."""

    gpu: str
    model: str
    num_tokens: int
    measured_s: float  # sum of LAYER_OPS medians
    gemm_measured_s: float  # the four GEMMs alone
    weights_mem_s: float  # linear weights streamed once / peak bandwidth
    activations_mem_s: float  # GEMM inputs and outputs of num_tokens / peak bandwidth
    compute_s: float  # 2 x linear params x num_tokens / peak FLOP/s


def source_commit(path: Path = VIDUR_CSV) -> str | None:
    """The Vidur commit named in the CSV's header comment."""
    with path.open() as f:
        for line in f:
            if line.startswith("#") and "at commit " in line:
                return line.split("at commit ", 1)[1].split()[0]
    return None


def load_points(path: Path = VIDUR_CSV) -> list[LayerTimePoint]:
    """Every row of the CSV as a :class:`LayerTimePoint` (profiles looked up by the row's names)."""
    with path.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    models = {name: load_model(name) for name in {row["model"] for row in rows}}
    gpus = {name: load_hardware(name) for name in {row["gpu"] for row in rows}}
    points = []
    for row in rows:
        points.append(layer_point(models[row["model"]], gpus[row["gpu"]], int(row["num_tokens"]),
                                  sum(float(row[f"{op}_ms"]) for op in LAYER_OPS) * 1e-3,
                                  sum(float(row[f"{op}_ms"]) for op in GEMM_OPS) * 1e-3))
    return points


def layer_point(model: ModelProfile, gpu: HardwareProfile, num_tokens: int, measured_s: float,
                gemm_measured_s: float) -> LayerTimePoint:
    """A measured layer with its roofline terms at ``gpu``'s datasheet roofs."""
    bw, peak, dtype = gpu.hbm_bandwidth_bytes_per_s, gpu.dense_flops_per_s, model.dtype_bytes
    return LayerTimePoint(
        gpu=gpu.name, model=model.name, num_tokens=num_tokens, measured_s=measured_s,
        gemm_measured_s=gemm_measured_s,
        weights_mem_s=model.linear_params_per_layer * dtype / bw,
        activations_mem_s=model.gemm_io_elements_per_token_per_layer * num_tokens * dtype / bw,
        compute_s=2 * model.linear_params_per_layer * num_tokens / peak,
    )
