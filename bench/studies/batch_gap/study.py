"""The Fig. 2/13 gap explained: why the paged mean batch and token-state share differ from the paper's.

``python -m pagedbench.bench batch_gap [--full]`` (config ``bench/studies/batch_gap/config.yaml``). The
default is the serving study's Fig. 2/13 point (OPT-13B on an A100-40GB, ShareGPT at the paper's 2 req/s,
paged bs=16, separate prompt steps), read from its config (:mod:`.serving_point`). Each cause changes
one knob of it (:mod:`.knobs`) and is simulated at the same seeds (:mod:`.runner`); each row reports the
mean batch, the token-state share read two ways (of the whole pool, as the serving study reports it; of
the memory requests hold, as we read the paper's Fig. 2: :mod:`.shares`) and the paired delta from the
default (:mod:`.decompose`). A combined run applies every cause marked as describing the paper's run whose
effect is above the noise; what it leaves to the paper's figures is the unexplained gap, beside the step
time the paper's batch implies by Little's law. Writes ``results/batch_gap.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml
from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records, sweep_runner
from pagedbench.bench.costmodel import kv_slot_budget, load_hardware, load_model
from pagedbench.bench.studies.batch_gap import decompose
from pagedbench.bench.studies.batch_gap import knobs as knobs_mod
from pagedbench.bench.studies.batch_gap.knobs import BatchGapConfigError, Cause, Knobs
from pagedbench.bench.studies.batch_gap.runner import Job, run_job
from pagedbench.bench.studies.batch_gap.serving_point import ServingPoint, read_serving_point

CONFIG = Path(__file__).resolve().parent / "config.yaml"
_KEYS = {"serving_config", "dataset", "seeds", "noise_z", "workers", "causes", "full"}


def load(path: Path, full: bool = False) -> dict:
    """The decomposition's config, checked: unknown keys, empty seeds, a cause's bad knob all raise."""
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or set(doc) - _KEYS:
        raise BatchGapConfigError(f"{path}: expected a mapping with keys from {sorted(_KEYS)}, got "
                                  f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
    if full:
        doc = {**doc, **(doc.get("full") or {})}
    causes = [Cause(**c) for c in doc["causes"]]
    if not doc["seeds"] or len({c.name for c in causes}) != len(causes):
        raise BatchGapConfigError(f"{path}: seeds must not be empty and cause names must be unique")
    return {**doc, "causes": causes}


def plan(default: Knobs, causes: list[Cause]) -> list[tuple[str, Knobs]]:
    """The default's row, then each cause's knobs (each differs from the default in its field alone)."""
    return [("default", default)] + [(c.name, knobs_mod.knobs_for(default, c)) for c in causes]


def _jobs(rows: list[tuple[str, Knobs]], point: ServingPoint, seeds) -> list[Job]:
    s = point.setting
    slots = kv_slot_budget(load_model(s.model), load_hardware(s.hardware), point.gpu_memory_utilization,
                           tensor_parallel_size=s.tensor_parallel_size).num_slots
    return [Job(name, k, s, point.dataset, slots, point.max_seq_len, seed, point.overload_z)
            for name, k in rows for seed in seeds]


def _run(rows, point: ServingPoint, cfg) -> dict[str, list[dict]]:
    jobs = _jobs(rows, point, cfg["seeds"])
    out: dict[str, list[dict]] = {name: [] for name, _ in rows}
    for job, res in zip(jobs, sweep_runner.map_points(run_job, jobs, workers=cfg["workers"])):
        out[job.row].append(res)
    return out


def run_study(cfg: dict) -> dict:
    serving = read_serving_point(env_mod.REPO_ROOT / cfg["serving_config"], cfg["dataset"])
    default = knobs_mod.default_knobs(serving)
    rows = plan(default, cfg["causes"])
    runs = _run(rows, serving, cfg)
    base = runs["default"]
    summaries = {name: decompose.summarize(name, base, runs[name], cfg["noise_z"]) for name, _ in rows}
    chosen = decompose.to_combine(cfg["causes"], summaries)
    combo_knobs = knobs_mod.combined(default, chosen)
    combo = decompose.summarize("combined", base, _run([("combined", combo_knobs)], serving, cfg)["combined"],
                                cfg["noise_z"])
    little = {name: decompose.per_token_ms(s["mean"]["mean_batch"], s["mean"]["achieved_rate"],
                                           s["mean"]["mean_output_len"])
              for name, s in [*summaries.items(), ("combined", combo)]}
    return {"config": {**cfg, "causes": [_cause(c) for c in cfg["causes"]]},
            "default_knobs": _knobs(default), "knobs": {name: _knobs(k) for name, k in rows},
            "combined_knobs": _knobs(combo_knobs), "combined_causes": [c.name for c in chosen],
            "paper": decompose.PAPER, "runs": runs, "rows": list(summaries.values()), "combined": combo,
            "per_token_ms": little,
            "paper_per_token_ms": decompose.per_token_ms(decompose.PAPER["mean_batch"], decompose.PAPER_RATE_RPS,
                                                         decompose.PAPER_MEAN_OUTPUT),
            "left_unexplained": decompose.left_unexplained(combo)}


def _cause(c: Cause) -> dict:
    return {f: getattr(c, f) for f in Cause.__slots__}


def _knobs(k: Knobs) -> dict:
    return {f: getattr(k, f) for f in Knobs.__slots__}


def main(argv: list[str]) -> None:
    from pagedbench.bench.studies.batch_gap import report

    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench batch_gap", description=__doc__)
    parser.add_argument("--full", action="store_true", help="more seeds (the config's `full` section)")
    parser.add_argument("--config", default=str(CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--out", default=str(env_mod.RESULTS_DIR), help="output folder (default: results/)")
    args = parser.parse_args(argv)
    cfg = load(Path(args.config), full=args.full)  # a bad value stops here, before anything runs
    start = time.perf_counter()
    doc = {"schema_version": records.SCHEMA_VERSION, "environment": env_mod.environment(), **run_study(cfg)}
    doc["wall_s"] = time.perf_counter() - start
    out = Path(args.out)
    records.write_json(out / "batch_gap.json", doc)  # the record first: a report bug loses no runs
    text = report.markdown(json.loads(json.dumps(doc, default=str)))  # as it reads back (tuples as lists)
    records.write_text(out / "batch_gap.md", text)
    print(text)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
