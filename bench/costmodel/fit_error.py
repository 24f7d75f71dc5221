"""How well each linear-layer model follows Vidur's measured curve, on every profiled token count.

``python -m pagedbench.bench.costmodel.fit_error [--out DIR]`` writes ``costmodel_fit.json`` and
``costmodel_fit.md`` (``results/`` by default); no network, about a minute on two cores. Per (GPU,
model), over every token count Vidur profiled at tensor-parallel degree 1, the relative error
``predicted / measured - 1`` of one layer outside attention (four GEMMs + five other operations) of:

- **old fit**: today's roofline (:mod:`pagedbench.bench.costmodel.vidur_fit`: two fractions and a layer
  overhead fitted on ten token counts, as the hardware profiles carry them);
- **tile fit**: :mod:`pagedbench.bench.costmodel.tile_fit` fitted on every token count of every model of
  that GPU (in-sample);
- **tile fit, model held out**: the same fit made without that model, the error to expect for a model
  Vidur did not profile (OPT, Llama-2-13B);
- **measured curve, token count held out**: the measured times themselves, each interior token count
  predicted from its two neighbours without it, linearly (**linear**) or following the tile steps
  (**tile steps**, :func:`pagedbench.bench.costmodel.vidur_curves.step_interpolate`): the error of
  following the profile between the counts it holds, what a simulator pays for a profiled model;

and the held-out GPU: A100's tile fit (and the old fit) on H100, through H100's datasheet roofs; and the
tensor-parallel check: one GPU's share of a layer at TP 2, 4 and 8 (Vidur's ten token counts,
``bench/data/vidur/mlp_tp_shards.csv``) against the per-GPU roofline the step cost uses at that
``tensor_parallel_size`` (:mod:`pagedbench.bench.costmodel.rank_shard`, the old fit's coefficients) and
the tile fit on the per-GPU GEMM shapes; and the whole step's linear part as the simulator prices it,
``StepCostModel.from_profiles(..., linear="roofline" | "tile")``'s time of a step of ``T`` tokens that
samples none and attends to nothing, less its step overhead, against ``layers`` x the measured layer (the
roofline's weight term streams the lm_head's weights too, which Vidur's layer profile does not hold).
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
from pagedbench.bench.costmodel.hardware import load_hardware
from pagedbench.bench.costmodel.models import load_model
from pagedbench.bench.costmodel.rank_shard import rank_shard
from pagedbench.bench.costmodel.step_cost import LINEAR_MODELS, StepCostModel
from pagedbench.bench.costmodel.tile_fit import GpuTileFit, fit_gpu
from pagedbench.bench.costmodel.vidur_curves import (
    ALL_TOKENS_CSV,
    TILE_STEP_TOKENS,
    LayerCurve,
    load_curves,
    step_interpolate,
)
from pagedbench.bench.costmodel.vidur_data import GEMM_OPS, layer_point, source_commit
from pagedbench.bench.costmodel.vidur_fit import Derating, predict_s
from tabulate import tabulate

SCHEMA_VERSION = 1
GOAL = {"max_abs_error": 0.15, "p90_abs_error": 0.08}
TP_SHARDS_CSV = ALL_TOKENS_CSV.with_name("mlp_tp_shards.csv")
HELD_OUT_GPU = ("a100-80gb", "h100-sxm")  # (fitted on, checked on)
ASSUMPTIONS = (
    "Measured = Vidur's median time of one layer's nine operations outside attention (4 GEMMs, 2 norms, "
    "rotary, activation, residual add), TP=1, fp16/bf16, at every token count it profiled (1..4096; 8192 "
    "for Llama-3).",
    "Datasheet roofs from bench/configs/hardware (a100-80gb, h100-sxm); nothing is tuned to the vLLM "
    "paper's numbers.",
    "The old fit's coefficients are those the hardware profiles carry (vidur_fit, fitted on A100 "
    "Llama-2-7B/70B at ten token counts; the same fractions on H100).",
    "The measured-curve rows leave out each interior token count in turn (the first and last have no two "
    "neighbours); a step between two profiled counts cannot be placed from the profile alone: linear "
    "interpolation puts half of it on each side, the tile-step rule puts it at the multiple of "
    f"{TILE_STEP_TOKENS} tokens (cuBLAS row tiles are multiples of 64; 128 gave the same or a larger "
    "held-out max on both GPUs).",
)


def error_stats(predicted: np.ndarray, measured: np.ndarray, num_tokens: np.ndarray) -> dict:
    """Relative errors summarised: signed mean, mean / p90 / max of the absolute, and where the max is."""
    err = predicted / measured - 1.0
    worst = int(np.abs(err).argmax())
    return {"num_points": int(err.size), "mean_error": float(err.mean()), "mean_abs_error": float(np.abs(err).mean()),
            "p90_abs_error": float(np.percentile(np.abs(err), 90)), "max_abs_error": float(np.abs(err).max()),
            "worst_num_tokens": int(num_tokens[worst]), "worst_error": float(err[worst])}


def meets_goal(stats: dict) -> bool:
    return stats["max_abs_error"] <= GOAL["max_abs_error"] and stats["p90_abs_error"] <= GOAL["p90_abs_error"]


def old_fit_s(curve: LayerCurve, gpu_name: str | None = None) -> np.ndarray:
    """Today's roofline at the curve's token counts, with the coefficients the GPU's profile carries."""
    gpu, model = load_hardware(gpu_name or curve.gpu), load_model(curve.model)
    points = [layer_point(model, gpu, int(n), 1.0, 1.0) for n in curve.num_tokens]
    return predict_s(points, Derating(gpu.bandwidth_fraction, gpu.compute_fraction, gpu.layer_overhead_s))


def rank_roofline_s(model_name: str, gpu_name: str, tensor_parallel_size: int, num_tokens: np.ndarray) -> np.ndarray:
    """One GPU's layer outside attention as the step cost prices it at ``tensor_parallel_size``."""
    model, gpu = load_model(model_name), load_hardware(gpu_name)
    shard = rank_shard(model, tensor_parallel_size)
    t = num_tokens.astype(np.float64)
    mem = (shard.linear_params_per_layer + shard.gemm_io_elements_per_token_per_layer * t) * model.dtype_bytes
    return gpu.layer_overhead_s + np.maximum(mem / gpu.achievable_bandwidth_bytes_per_s,
                                             2 * shard.linear_params_per_layer * t / gpu.achievable_flops_per_s)


def tensor_parallel_rows(fits: dict[str, GpuTileFit], path: Path = TP_SHARDS_CSV) -> list[dict]:
    """Per (GPU, model, TP): the per-GPU roofline's and the tile fit's error on Vidur's TP profiles."""
    with path.open() as f:
        raw = list(csv.DictReader(line for line in f if not line.startswith("#")))
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in raw:
        groups.setdefault((r["gpu"], r["model"], int(r["tensor_parallel_size"])), []).append(r)
    rows = []
    for (gpu, model, tp), rs in sorted(groups.items()):
        n = np.array([int(r["num_tokens"]) for r in rs])
        y = np.array([float(r["layer_ms"]) for r in rs]) * 1e-3
        rows.append({"gpu": gpu, "model": model, "tensor_parallel_size": tp,
                     "step_cost_roofline": error_stats(rank_roofline_s(model, gpu, tp, n), y, n),
                     "tile_fit": error_stats(fits[gpu].layer_time_s(load_model(model), load_hardware(gpu), n, tp),
                                             y, n)})
    return rows


def step_linear_rows(curves: Sequence[LayerCurve]) -> list[dict]:
    """Per (GPU, model): the step cost's linear part at each ``linear`` model vs layers x the measured layer."""
    rows = []
    for curve in curves:
        model, gpu = load_model(curve.model), load_hardware(curve.gpu)
        measured = model.num_hidden_layers * curve.layer_s
        row = {"gpu": curve.gpu, "model": curve.model}
        for linear in LINEAR_MODELS:
            cost = StepCostModel.from_profiles(model, gpu, linear=linear)
            step_s = np.array([cost.time_from_totals_s(int(t), 0, 0) for t in curve.num_tokens])
            predicted = step_s - gpu.step_overhead_s
            row[linear] = error_stats(predicted, measured, curve.num_tokens)
        rows.append(row)
    return rows


def tile_fit_s(fit: GpuTileFit, curve: LayerCurve, gpu_name: str | None = None) -> np.ndarray:
    return fit.layer_time_s(load_model(curve.model), load_hardware(gpu_name or curve.gpu), curve.num_tokens)


def curve_held_out_stats(curve: LayerCurve, step: int | None = None) -> dict:
    """Each interior token count predicted from the profile without it: linearly between its two
    neighbours (``step`` None), or by :func:`step_interpolate` with tiles of ``step`` tokens."""
    t, y = curve.num_tokens, curve.layer_s
    predicted = []
    for k in range(1, len(t) - 1):
        keep = np.arange(len(t)) != k
        predicted.append(step_interpolate(t[keep], y[keep], int(t[k]), step))
    return error_stats(np.array(predicted), y[1:-1], t[1:-1])


def _fit_record(fit: GpuTileFit) -> dict:
    return {"gemms": {op: asdict(g) for op, g in zip(GEMM_OPS, fit.gemms)},
            "other_fixed_s": fit.other_fixed_s, "other_s_per_element": fit.other_s_per_element}


def gpu_rows(curves: Sequence[LayerCurve], fit: GpuTileFit) -> list[dict]:
    """One row per model of one GPU: the four models' error statistics (module docstring)."""
    rows = []
    for curve in curves:
        others = [c for c in curves if c.model != curve.model]
        held_out = fit_gpu(others)
        y, n = curve.layer_s, curve.num_tokens
        row = {"gpu": curve.gpu, "model": curve.model,
               "old_fit": error_stats(old_fit_s(curve), y, n),
               "tile_fit": error_stats(tile_fit_s(fit, curve), y, n),
               "tile_fit_model_held_out": error_stats(tile_fit_s(held_out, curve), y, n),
               "measured_curve_linear_count_held_out": curve_held_out_stats(curve),
               "measured_curve_tile_steps_count_held_out": curve_held_out_stats(curve, TILE_STEP_TOKENS)}
        row["meets_goal"] = {k: meets_goal(v) for k, v in row.items() if isinstance(v, dict)}
        rows.append(row)
    return rows


def fit_error(csv_path: Path = ALL_TOKENS_CSV) -> dict:
    """The record: per-GPU fits, per-(GPU, model) errors, and the held-out GPU."""
    curves = load_curves(csv_path)
    gpus = sorted({c.gpu for c in curves})
    fits = {gpu: fit_gpu([c for c in curves if c.gpu == gpu]) for gpu in gpus}
    rows = [r for gpu in gpus for r in gpu_rows([c for c in curves if c.gpu == gpu], fits[gpu])]
    fitted_on, checked_on = HELD_OUT_GPU
    held_out = []
    for curve in (c for c in curves if c.gpu == checked_on):
        y, n = curve.layer_s, curve.num_tokens
        held_out.append({"model": curve.model,
                         "old_fit": error_stats(old_fit_s(curve, checked_on), y, n),
                         "tile_fit": error_stats(tile_fit_s(fits[fitted_on], curve, checked_on), y, n)})
    return {
        "schema_version": SCHEMA_VERSION,
        "source": {"repository": "github.com/microsoft/vidur", "commit": source_commit(csv_path),
                   "data": "data/profiling/compute/{a100,h100}/<org>/<model>/mlp.csv, TP=1, every token count",
                   "extract": "bench/data/vidur/mlp_tp1_all_tokens.csv", "licence": "MIT"},
        "assumptions": list(ASSUMPTIONS),
        "goal": GOAL,
        "tile_fits": {gpu: _fit_record(f) for gpu, f in fits.items()},
        "old_fits": {gpu: asdict(Derating(g.bandwidth_fraction, g.compute_fraction, g.layer_overhead_s))
                     for gpu, g in ((name, load_hardware(name)) for name in gpus)},
        "rows": rows,
        "held_out_gpu": {"fitted_on": fitted_on, "checked_on": checked_on, "rows": held_out},
        "tensor_parallel": tensor_parallel_rows(fits),
        "step_linear": step_linear_rows(curves),
    }


def _cell(stats: dict) -> str:
    return (f"{stats['mean_error']:+.1%} / {stats['mean_abs_error']:.1%} / {stats['p90_abs_error']:.1%} / "
            f"{stats['max_abs_error']:.1%} @{stats['worst_num_tokens']}")


def _fit_table(record: dict) -> list[str]:
    rows = []
    for gpu, fit in record["tile_fits"].items():
        for op, g in fit["gemms"].items():
            rows.append([gpu, op, g["tile_m"], g["p"], f"{g['bandwidth_fraction']:.2f}",
                         f"{g['compute_fraction']:.2f}", f"{g['overhead_s'] * 1e6:.1f}"])
        rows.append([gpu, "other ops", "", "", "", "", f"{fit['other_fixed_s'] * 1e6:.1f} + "
                     f"{fit['other_s_per_element'] * 1e12:.3f} ps x T x elements"])
    return tabulate(rows, headers=["gpu", "GEMM", "tile_m", "p", "bw fraction", "compute fraction", "overhead µs"],
                    tablefmt="github").splitlines()


def markdown(record: dict) -> str:
    from pagedbench.bench import environment as env_mod

    goal = record["goal"]
    kinds = [("old_fit", "old fit"), ("tile_fit", "tile fit"), ("tile_fit_model_held_out", "tile fit, model held out"),
             ("measured_curve_linear_count_held_out", "measured curve linear, count held out"),
             ("measured_curve_tile_steps_count_held_out", "measured curve tile steps, count held out")]
    rows = [[r["gpu"], r["model"], r["old_fit"]["num_points"],
             *(_cell(r[k]) + (" ✓" if r["meets_goal"][k] else "") for k, _ in kinds)] for r in record["rows"]]
    held = record["held_out_gpu"]
    held_rows = [[r["model"], r["tile_fit"]["num_points"], _cell(r["old_fit"]), _cell(r["tile_fit"])
                  + (" ✓" if meets_goal(r["tile_fit"]) else "")] for r in held["rows"]]
    src = record["source"]
    lines = [
        "# Linear-layer cost models vs Vidur's measured curve, every profiled token count", "",
        f"Source: {src['repository']} @ {src['commit']} ({src['licence']}), {src['data']}; extract "
        f"`{src['extract']}`. Generated by `python -m pagedbench.bench.costmodel.fit_error`.", "",
        *(env_mod.environment_markdown(record["environment"]).splitlines() if "environment" in record else []), "",
        "Each cell: signed mean / mean |error| / p90 |error| / max |error| @ its token count, of predicted / "
        f"measured - 1 for one layer outside attention. ✓: max <= {goal['max_abs_error']:.0%} and p90 <= "
        f"{goal['p90_abs_error']:.0%} (the goal).", "",
        *tabulate(rows, headers=["gpu", "model", "points", *(name for _, name in kinds)],
                  tablefmt="github").splitlines(), "",
        f"## Held-out GPU: {held['fitted_on']}'s fits on {held['checked_on']} (its datasheet roofs)", "",
        *tabulate(held_rows, headers=["model", "points", "old fit", "tile fit"], tablefmt="github").splitlines(), "",
        "## Tensor parallelism: one GPU's share of a layer vs Vidur's TP profiles (ten token counts)", "",
        "The step cost's per-GPU roofline at that tensor_parallel_size (rank_shard, old fit's coefficients) "
        "and the tile fit on the per-GPU GEMM shapes (all-reduces not included: Vidur times them apart).", "",
        *tabulate([[r["gpu"], r["model"], r["tensor_parallel_size"], _cell(r["step_cost_roofline"]),
                    _cell(r["tile_fit"])] for r in record.get("tensor_parallel", [])],
                  headers=["gpu", "model", "tp", "step-cost roofline", "tile fit"], tablefmt="github").splitlines(), "",
        "## The step cost's linear part, as the simulator prices a step (every profiled token count)", "",
        "StepCostModel.from_profiles(..., linear=...): a step of T tokens sampling none, less the step overhead, "
        "against layers x the measured layer; the roofline's weight term also streams the lm_head's weights.", "",
        *tabulate([[r["gpu"], r["model"], r["roofline"]["num_points"],
                    *(_cell(r[k]) + (" ✓" if meets_goal(r[k]) else "") for k in LINEAR_MODELS)]
                   for r in record.get("step_linear", [])],
                  headers=["gpu", "model", "points", *(f'linear="{k}"' for k in LINEAR_MODELS)],
                  tablefmt="github").splitlines(), "",
        "## Tile fit coefficients (per GPU, fitted on every token count of every profiled model)", "",
        *_fit_table(record), "",
        "## Assumptions", "", *(f"- {a}" for a in record["assumptions"]), "",
    ]
    return "\n".join(lines)


def write_record(record: dict, out_dir: Path) -> list[Path]:
    from pagedbench.bench.common import records

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "costmodel_fit.json", out_dir / "costmodel_fit.md"]
    records.write_json(paths[0], record)
    records.write_text(paths[1], markdown(record))
    return paths


def main(argv: list[str] | None = None) -> dict:
    from pagedbench.bench.common import environment as env_mod  # imports torch (device description): only when run

    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench.costmodel.fit_error", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(env_mod.RESULTS_DIR), help="output folder (default: results/)")
    parser.add_argument("--full", action="store_true", help="(the same comparison: it has no larger sweep)")
    args = parser.parse_args(argv)
    record = {"environment": env_mod.environment(), **fit_error()}
    for path in write_record(record, Path(args.out)):
        print(f"wrote {path}")
    return record


if __name__ == "__main__":
    main()
