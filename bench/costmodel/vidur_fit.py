"""Fit the roofline's derating on Vidur's A100 profiles; check it on held-out models and on H100.

Per layer, outside attention, the step-cost model predicts (as in :mod:`pagedbench.bench.costmodel.step_cost`)::

    t(T) = layer_overhead + max((W + A*T) / (bandwidth * bw_fraction), F*T / (peak * compute_fraction))

The fit set is A100 (80 GB) Llama-2-7B and Llama-2-70B at 1..4096 tokens. The two fractions are found
on a grid (0.005 steps) and, for each pair, the overhead in closed form, minimising the mean squared
relative error. Every other (model, GPU) is held out: other models on A100, every model on H100 (with
the A100 fractions on H100's datasheet roofs). ``python -m pagedbench.bench.costmodel.vidur_fit [--out DIR]``
writes ``vidur_fit.json`` and ``vidur_fit.md`` (results/ by default); no network.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pagedbench.bench.costmodel.vidur_data import VIDUR_CSV, LayerTimePoint, load_points, source_commit
from tabulate import tabulate

SCHEMA_VERSION = 1
FIT_GPU = "a100-80gb"
FIT_MODELS = ("llama-2-7b", "llama-2-70b")
GRID = np.round(np.arange(0.30, 1.0 + 1e-9, 0.005), 3)
TARGET_ERROR = 0.15  # the goal for held-out points (|predicted / measured - 1|)


@dataclass(frozen=True, slots=True)
class Derating:
    """The fitted coefficients: shares of the datasheet roofs reached, and a fixed cost per layer."""

    bandwidth_fraction: float
    compute_fraction: float
    layer_overhead_s: float


def predict_s(points: list[LayerTimePoint], d: Derating) -> np.ndarray:
    mem = np.array([p.weights_mem_s + p.activations_mem_s for p in points]) / d.bandwidth_fraction
    comp = np.array([p.compute_s for p in points]) / d.compute_fraction
    return np.maximum(mem, comp) + d.layer_overhead_s


def fit_derating(points: list[LayerTimePoint]) -> Derating:
    """Least mean squared relative error over the fraction grid, with the best overhead (>= 0) per pair."""
    y = np.array([p.measured_s for p in points])
    mem = np.array([p.weights_mem_s + p.activations_mem_s for p in points])
    comp = np.array([p.compute_s for p in points])
    roof = np.maximum(mem / GRID[:, None, None], comp / GRID[None, :, None])  # [bw, compute, point]
    w2 = 1.0 / y**2
    # d/do sum(((roof + o - y) / y)^2) = 0  ->  o = sum((y - roof) w2) / sum(w2)
    overhead = np.clip(((y - roof) * w2).sum(-1) / w2.sum(), 0.0, None)
    loss = (((roof + overhead[..., None] - y) / y) ** 2).mean(-1)
    i, j = np.unravel_index(int(loss.argmin()), loss.shape)
    return Derating(float(GRID[i]), float(GRID[j]), float(overhead[i, j]))


def _split(p: LayerTimePoint) -> str:
    if p.gpu == FIT_GPU:
        return "fit" if p.model in FIT_MODELS else "held-out model"
    return "held-out gpu"


def _summary(rows: list[dict]) -> dict[str, dict]:
    groups: dict[str, list[float]] = {}
    for r in rows:
        for key in (r["split"], f"{r['gpu']}/{r['model']}"):
            groups.setdefault(key, []).append(abs(r["error"]))
    return {k: {"num_points": len(v), "mean_abs_error": float(np.mean(v)), "max_abs_error": float(np.max(v)),
                "share_within_target": float(np.mean(np.array(v) <= TARGET_ERROR))}
            for k, v in groups.items()}


def fit_vidur(csv_path: Path = VIDUR_CSV) -> dict:
    """The fit and its check, as a record: coefficients, one row per point, summaries by split."""
    points = load_points(csv_path)
    derating = fit_derating([p for p in points if _split(p) == "fit"])
    predicted = predict_s(points, derating)
    no_derating = predict_s(points, Derating(1.0, 1.0, 0.0))
    rows = [{"model": p.model, "gpu": p.gpu, "num_tokens": p.num_tokens, "split": _split(p),
             "measured_ms": p.measured_s * 1e3, "predicted_ms": float(t) * 1e3,
             "error": float(t) / p.measured_s - 1.0, "roofline_no_derating_ms": float(u) * 1e3}
            for p, t, u in zip(points, predicted, no_derating)]
    slowdown = {gpu: float(np.median([r["measured_ms"] / r["roofline_no_derating_ms"]
                                      for r in rows if r["gpu"] == gpu]))
                for gpu in sorted({r["gpu"] for r in rows})}
    return {
        "schema_version": SCHEMA_VERSION,
        "source": {"repository": "github.com/microsoft/vidur", "commit": source_commit(csv_path),
                   "data": "data/profiling/compute/{a100,h100}/<model>/mlp.csv, TP=1", "licence": "MIT"},
        "measured": "one layer outside attention: sum of Vidur's nine per-layer operations (ms)",
        "fit_set": {"gpu": FIT_GPU, "models": list(FIT_MODELS)},
        "coefficients": {"bandwidth_fraction": derating.bandwidth_fraction,
                         "compute_fraction": derating.compute_fraction,
                         "layer_overhead_s": derating.layer_overhead_s},
        "measured_over_roofline_no_derating_median": slowdown,
        "target_abs_error": TARGET_ERROR,
        "summary": _summary(rows),
        "rows": rows,
    }


def markdown(record: dict) -> str:
    c = record["coefficients"]
    lines = [
        "# Step-cost roofline vs Vidur's measured linear layers", "",
        f"Source: {record['source']['repository']} @ {record['source']['commit']}"
        f" ({record['source']['licence']}).",
        f"Measured: {record['measured']}. Fit on {record['fit_set']['gpu']} "
        f"{', '.join(record['fit_set']['models'])}.", "",
        f"Fitted: bandwidth fraction {c['bandwidth_fraction']:.3f}, compute fraction "
        f"{c['compute_fraction']:.3f}, layer overhead {c['layer_overhead_s'] * 1e6:.1f} µs.", "",
        tabulate([[k, v["num_points"], f"{v['mean_abs_error']:.1%}", f"{v['max_abs_error']:.1%}",
                   f"{v['share_within_target']:.0%}"] for k, v in record["summary"].items()],
                 headers=["split / gpu/model", "points", "mean abs error", "max abs error",
                          f"within {record['target_abs_error']:.0%}"], tablefmt="github"), "",
        tabulate([[r["gpu"], r["model"], r["num_tokens"], f"{r['measured_ms']:.4f}",
                   f"{r['predicted_ms']:.4f}",
                   f"{r['error']:+.1%}", r["split"]] for r in record["rows"]],
                 headers=["gpu", "model", "tokens", "measured ms", "predicted ms", "error", "split"],
                 tablefmt="github"), "",
    ]
    return "\n".join(lines)


def write_record(record: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "vidur_fit.json", out_dir / "vidur_fit.md"]
    from pagedbench.bench import records

    records.write_json(paths[0], record)
    records.write_text(paths[1], markdown(record))
    return paths


def main(argv: list[str] | None = None) -> dict:
    from pagedbench.bench import environment as env_mod  # imports torch (device description): only when run

    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench.costmodel.vidur_fit", description=__doc__)
    parser.add_argument("--out", default=str(env_mod.RESULTS_DIR / "costmodel"), help="output folder")
    parser.add_argument("--full", action="store_true", help="(the same fit: it has no larger sweep)")
    args = parser.parse_args(argv)
    record = {"environment": env_mod.environment(), **fit_vidur()}
    for path in write_record(record, Path(args.out)):
        print(f"wrote {path}")
    c = record["coefficients"]
    print(f"bandwidth_fraction={c['bandwidth_fraction']} compute_fraction={c['compute_fraction']} "
          f"layer_overhead_s={c['layer_overhead_s']:.3g}")
    return record


if __name__ == "__main__":
    main()
