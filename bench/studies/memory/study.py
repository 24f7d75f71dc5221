"""The memory-waste study: where KV memory goes under Orca's reservations and paging, beyond Fig. 2/13.

``python -m pagedbench.bench --only memory_study`` (or ``main([])``) runs the default config
(``bench/configs/memory.yaml``); ``--full`` the larger sweeps. For every workload, every allocator
(Orca Max / Pow2 / Oracle on a buddy or first-fit arena, paged at block sizes 1..256) is simulated
(:mod:`pagedbench.bench.sim.simulator`: the real scheduler on a simulated clock) under one KV budget, with
the step times of the step-cost model (:mod:`pagedbench.bench.costmodel`) for the config's model and
GPU: no step time is guessed. What only this study has: the block-size sweep (the paper's Fig. 18b),
buddy vs first-fit placement, and the parallel-sampling saving (Figure 15, measured with
``BlockManager.fork``). Fig. 2 and 13 come from the serving study's runs (``results/serving.md``).
Writes ``results/memory.json`` (records), ``results/memory.md`` (tables, the paper's anchors beside
ours) and ``results/memory_block_size.png``, and prints the tables.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from pagedbench.bench import workloads
from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records
from pagedbench.bench.common.progress import progress_enabled
from pagedbench.bench.costmodel import StepCostModel, load_hardware, load_model
from pagedbench.bench.sim.points import step_time_fn
from pagedbench.bench.sim.sharing import sharing_saving
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, SimResult, simulate
from tqdm import tqdm

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "memory.yaml"
MIN_MEASURED_STEPS = 200  # a run measured over fewer steps is marked invalid


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    dataset: str | None = None  # a synthetic dataset (bench.workloads.DATASETS) ...
    num_requests: int = 0
    rate: float | None = None  # requests/s (Poisson), None: all at once
    trace: str | None = None  # ... or a JSONL trace, relative to the repository root


@dataclass(frozen=True, slots=True)
class SharingSpec:
    dataset: str
    num_requests: int
    block_size: int
    n: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StudyConfig:
    kv_slots: int
    max_seq_len: int
    watermark: float
    warmup_frac: float
    seed: int
    model: str  # the step-cost model's model and GPU profiles (bench/configs/models, .../hardware)
    hardware: str
    workloads: tuple[WorkloadSpec, ...]
    orca_policies: tuple[str, ...]
    orca_placements: tuple[str, ...]
    block_sizes: tuple[int, ...]
    vllm_block_size: int
    sharing: SharingSpec
    drain: bool = True  # run until every request is done (latency over all; shares in the window only)

    def sim(self) -> SimConfig:
        return SimConfig(self.kv_slots, self.max_seq_len, watermark=self.watermark, warmup_frac=self.warmup_frac,
                         drain=self.drain)

    def step_time_s(self):
        return step_time_fn(StepCostModel.from_profiles(load_model(self.model), load_hardware(self.hardware)))


def load_config(path: str | Path = CONFIG, *, full: bool = False) -> StudyConfig:
    raw = yaml.safe_load(Path(path).read_text())
    overrides = raw.pop("full", {}) or {}
    if full:
        raw.update(overrides)
    known = {f.name for f in dataclasses.fields(StudyConfig)}
    if set(raw) - known:
        raise ValueError(f"{path}: unknown keys {sorted(set(raw) - known)}")
    raw["workloads"] = tuple(WorkloadSpec(**w) for w in raw["workloads"])
    s = raw["sharing"]
    raw["sharing"] = SharingSpec(s["dataset"], s["num_requests"], s["block_size"], tuple(s["n"]))
    for key in ("orca_policies", "orca_placements", "block_sizes"):
        raw[key] = tuple(raw[key])
    return StudyConfig(**raw)


def load_trace(w: WorkloadSpec, cfg: StudyConfig) -> tuple[workloads.Request, ...]:
    if w.trace is not None:
        return workloads.load_jsonl(env_mod.REPO_ROOT / w.trace, rate=w.rate, seed=cfg.seed)
    return workloads.synthetic(w.dataset, w.num_requests, rate=w.rate, seed=cfg.seed,
                               max_seq_len=cfg.max_seq_len)


def allocators(cfg: StudyConfig) -> list[AllocatorSpec]:
    """Orca at every policy and placement, and paged at every block size."""
    orca = [AllocatorSpec("orca", 1, p, pl) for pl in cfg.orca_placements for p in cfg.orca_policies]
    return orca + [AllocatorSpec("paged", b) for b in cfg.block_sizes]


def run_record(w: WorkloadSpec, spec: AllocatorSpec, r: SimResult, wall_s: float) -> dict:
    reasons = []
    if r.num_measured_steps < MIN_MEASURED_STEPS:
        reasons.append(f"only {r.num_measured_steps} measured steps (< {MIN_MEASURED_STEPS})")
    return {
        "workload": dataclasses.asdict(w),
        "allocator": {"name": spec.name, "kind": spec.kind, "block_size": spec.block_size,
                      "policy": spec.policy if spec.kind == "orca" else None,
                      "placement": spec.placement if spec.kind == "orca" else None},
        "total_slots": r.total_slots,
        "shares": dataclasses.asdict(r.shares),
        "mean_running": r.mean_running,
        "peak_running": r.peak_running,
        "num_preemptions": r.num_preemptions,
        "num_finished": r.num_finished,
        "mean_normalized_latency_s": r.mean_normalized_latency_s,
        "num_steps": r.num_steps,
        "num_measured_steps": r.num_measured_steps,
        "wall_s": wall_s,
        "validity": {"valid": not reasons, "reasons": reasons},
    }


def run_study(cfg: StudyConfig, *, progress: bool | None = None) -> dict:
    """Every simulation of the study; returns the JSON document (without the environment).
    ``progress``: draw a bar (None: on a terminal, see :mod:`bench.common.progress`)."""
    if progress is None:
        progress = progress_enabled()
    jobs = [(w, spec) for w in cfg.workloads for spec in allocators(cfg)]
    traces = {w.name: load_trace(w, cfg) for w in cfg.workloads}
    step_time_s = cfg.step_time_s()
    runs = []
    for w, spec in tqdm(jobs, desc="memory study", unit="run", disable=not progress):
        start = time.perf_counter()
        result = simulate(traces[w.name], spec, cfg.sim(), step_time_s=step_time_s)
        runs.append(run_record(w, spec, result, time.perf_counter() - start))
    sh = cfg.sharing
    trace = workloads.synthetic(sh.dataset, sh.num_requests, seed=cfg.seed, max_seq_len=cfg.max_seq_len)
    sharing = [{"dataset": sh.dataset, "num_requests": sh.num_requests, "block_size": sh.block_size, "n": n,
                "saving": sharing_saving(trace, n, sh.block_size)} for n in sh.n]
    return {"config": dataclasses.asdict(cfg), "runs": runs, "sharing": sharing}


def main(argv: list[str]) -> None:
    from pagedbench.bench.studies.memory import plots as memory_plots
    from pagedbench.bench.studies.memory import report as memory_report

    parser = records.study_parser("python -m pagedbench.bench memory_study", __doc__, CONFIG, env_mod.RESULTS_DIR)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, full=args.full)
    doc = {"environment": env_mod.environment(), **run_study(cfg)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records.write_json(out / "memory.json", doc)
    text = memory_report.markdown(doc)
    records.write_text(out / "memory.md", text)
    if not args.no_plots:
        memory_plots.plot_all(doc, out)
    print(text)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
