"""Figure 14 of the vLLM paper: serving with parallel sampling and beam search, paged against Orca.

``python -m pagedbench.bench --only beam_serving [--full]``. The paper's setting: OPT-13B on an A100-40GB
(the serving study's cost model and KV budget), Alpaca-like requests, the paper's scheduler policy
(``separate`` prompt steps, vLLM v0.1). Each request is a group (:mod:`pagedbench.bench.sim.group_replay`):
one sample (the basic-sampling reference), ``n`` = 2/4/6 parallel samples, or a beam search of width
2/4/6. The real scheduler and KV managers serve it (:mod:`pagedbench.bench.sim.simulator`):

- paged (block size 16): a group's samples fork from its computed prompt and its beams fork from each
  other, sharing blocks, copying a shared partial block on write; a pruned beam is freed at once;
- Orca (Max / Pow2 / Oracle on a buddy arena, and Oracle on first fit): every sample and every beam
  holds a reservation of its own (sized by the policy), computed from its own prompt; a beam that forks
  takes a reservation of its own and a copy of its parent's tokens. Nothing is shared.

Which beams survive each round comes from beam trajectories recorded from ``LLM.beam_search`` on the
tiny random model over Alpaca-like prompts (:func:`pagedbench.bench.studies.beam.study.record_trajectories`,
the memory study's recordings), replayed by the simulated executor.

The method is the serving study's (:mod:`pagedbench.bench.studies.serving.study`): the Poisson arrivals of a
span per point, a warm-up and cool-down left out, the overload test, and per (group, manager, seed) the
capacity: the highest rate whose normalized latency stays below ``threshold`` x the low-load value of
the paged manager for that group. The ratio of paged to Orca (Oracle) capacities over the seeds is
paired (the same arrivals). Writes ``results/beam_serving.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records, sweep_runner
from pagedbench.bench.costmodel import kv_slot_budget, load_hardware, load_model
from pagedbench.bench.sim.capacity_search import ratio_estimate
from pagedbench.bench.sim.group_replay import GroupSpec
from pagedbench.bench.sim.points import Method, Point, run_point
from pagedbench.bench.sim.serving_search import low_load_rate, search
from pagedbench.bench.sim.settings import Dataset, Setting
from pagedbench.bench.sim.simulator import AllocatorSpec

#: the paper's Figure 14 text: vLLM's capacity over Orca (Oracle)'s, basic sampling (Fig. 12's Alpaca run)
#: and beam width 6; the other panels are given as plots only
PAPER_RATIO = {"n=1": 1.3, "beam=6": 2.3}

# Oracle on first fit too: Orca's waste without the buddy arena's rounding
ALLOCATORS = (AllocatorSpec("orca", 1, "max"), AllocatorSpec("orca", 1, "pow2"), AllocatorSpec("orca", 1, "oracle"),
              AllocatorSpec("orca", 1, "oracle", "first_fit"), AllocatorSpec("paged", 16))


@dataclass(frozen=True, slots=True)
class BeamServingConfig:
    model: str = "opt-13b"
    hardware: str = "a100-40gb"
    dataset: str = "alpaca"
    policy: str = "separate"  # the paper's system: prompt steps apart from decode steps
    max_seq_len: int = 2048
    gpu_memory_utilization: float = 0.9
    linear_model: str = "tile"  # the serving study's pricing of the linear layers (bench/sim/settings.py)
    groups: tuple[tuple[str, int], ...] = (("sample", 1), ("parallel", 2), ("parallel", 4), ("parallel", 6),
                                           ("beam", 2), ("beam", 4), ("beam", 6))
    allocators: tuple[AllocatorSpec, ...] = ALLOCATORS
    threshold: float = 2.0  # the latency line: threshold x the low-load normalized latency
    seeds: tuple[int, ...] = (0, 1, 2)  # the same arrivals for every manager per seed: ratios are paired
    span_s: float = 60.0
    low_load_requests: int = 60
    warmup_frac: float = 0.1
    cooldown_frac: float = 0.1
    overload_z: float = 3.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01
    bisection_steps: int = 5  # after x4 bracketing: capacities to within 4 ** (1 / 32) = 4.4%
    workers: int = 2  # simulations run in parallel processes
    num_trajectories: int = 4  # recorded searches per width (the memory study's)
    trajectory_rounds: int = 256
    trajectory_model: str = "tiny"

    def __post_init__(self) -> None:
        if not self.seeds or self.workers < 1 or self.threshold <= 1 or self.bisection_steps < 0:
            raise ValueError(f"seeds must not be empty, workers >= 1, threshold > 1, bisection_steps >= 0; got "
                             f"{self.seeds}, {self.workers}, {self.threshold}, {self.bisection_steps}")
        for kind, width in self.groups:
            GroupSpec(kind, width, (((0,) * width,) * 2,) if kind == "beam" else ())  # names a bad kind or width

    @property
    def setting(self) -> Setting:
        return Setting(f"{self.model}@{self.hardware}", self.model, self.hardware, self.max_seq_len,
                       linear_model=self.linear_model)


#: `make bench`'s share of a 15-minute budget: the groups the paper's text gives ratios for (n=1, beam=6)
#: and the widest parallel sampling, 30 s spans, capacities to within 4 ** (1 / 16) = 9%; the other widths
#: and Orca (Oracle) on first fit are the full run's (all seven groups took 1,470 s on two loaded cores)
QUICK = BeamServingConfig(span_s=30.0, bisection_steps=4, groups=(("sample", 1), ("parallel", 6), ("beam", 6)),
                          allocators=tuple(a for a in ALLOCATORS if a.placement != "first_fit"))
FULL = BeamServingConfig(seeds=(0, 1, 2, 3, 4), span_s=600.0, bisection_steps=6)


def record(cfg: BeamServingConfig) -> dict[int, tuple]:
    """Beam trajectories per width, recorded from the tiny model (see the module docstring)."""
    from pagedbench.bench.studies.beam.study import BeamStudyConfig, record_trajectories

    rec = BeamStudyConfig(num_trajectories=cfg.num_trajectories, trajectory_rounds=cfg.trajectory_rounds,
                          model=cfg.trajectory_model)
    widths = sorted({w for kind, w in cfg.groups if kind == "beam"})
    return {w: tuple(tuple(tuple(kept) for kept in t) for t in record_trajectories(rec, w)) for w in widths}


def groups(cfg: BeamServingConfig, trajectories: dict[int, tuple]) -> list[GroupSpec]:
    return [GroupSpec(kind, w, trajectories[w] if kind == "beam" else ()) for kind, w in cfg.groups]


def _method(cfg: BeamServingConfig) -> Method:
    return Method(cfg.span_s, cfg.low_load_requests, cfg.warmup_frac, cfg.cooldown_frac, cfg.overload_z,
                  cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.watermark, ())


def _search_job(args) -> dict:
    return search(*args)


def run_study(cfg: BeamServingConfig, trajectories: dict[int, tuple], *, progress: bool = True,
              address: str | None = None) -> dict:
    """Every search of ``cfg`` on ``cfg.workers`` local processes, or on the Ray cluster at ``address`` (or
    ``RAY_ADDRESS``; :mod:`pagedbench.bench.common.sweep_runner`)."""
    setting, dataset = cfg.setting, Dataset(cfg.dataset, cfg.dataset)
    slots = kv_slot_budget(load_model(cfg.model), load_hardware(cfg.hardware), cfg.gpu_memory_utilization)
    rate = low_load_rate(setting, dataset, cfg.max_seq_len)
    paged = next(a for a in cfg.allocators if a.kind == "paged")
    specs = groups(cfg, trajectories)
    lows = [Point(setting, dataset, paged, cfg.policy, rate, seed, cfg.max_seq_len, slots.num_slots, False,
                  _method(cfg), group=g) for g in specs for seed in cfg.seeds]
    name = str(cfg.threshold)
    run = {"workers": cfg.workers, "address": address}
    low_rows = sweep_runner.map_points(run_point, lows, **run)
    jobs = [(dataclasses.replace(low, allocator=a), row["normalized_latency_s"], [name], cfg.bisection_steps)
            for low, row in zip(lows, low_rows) for a in cfg.allocators]
    searches = []
    for (base, *_), res in zip(jobs, sweep_runner.imap_points(_search_job, jobs, **run)):
        res["group"] = base.group.name
        searches.append(res)
        if progress:
            cap = res["capacity"][name]
            print(f"  {res['group']} {res['allocator']} seed {res['seed']}: capacity "
                  f"{'none' if cap is None else f'{cap:.3g}'} req/s", flush=True)
    return {"config": _config_doc(cfg), "kv_slots": slots.num_slots, "low_load_rate": rate, "criterion": name,
            "searches": searches, "ratios": ratios(searches, name, [g.name for g in specs]),
            "trajectories": {w: _shape(t) for w, t in trajectories.items()}}


def ratios(searches: list[dict], criterion: str, group_names: list[str]) -> list[dict]:
    """Per group: paged's capacity over each Orca policy's, paired by seed (None where one has none)."""
    rows = []
    for g in group_names:
        mine = [s for s in searches if s["group"] == g]
        paged = {s["seed"]: s for s in mine if s["allocator"].startswith("paged")}
        for orca in sorted({s["allocator"] for s in mine if not s["allocator"].startswith("paged")}):
            theirs = {s["seed"]: s for s in mine if s["allocator"] == orca}
            pairs = [(paged[k], theirs[k]) for k in sorted(paged) if k in theirs]
            ok = [(p, o) for p, o in pairs if p["capacity"][criterion] and o["capacity"][criterion]]
            est = None
            if ok and len(ok) == len(pairs):
                def side(s):
                    return (s["capacity"][criterion], s["capacity_bracket"][criterion][1])
                e = ratio_estimate([side(p) for p, _ in ok], [side(o) for _, o in ok])
                est = {"mean": e.mean, "low": e.low, "high": e.high, "num_seeds": e.num_seeds}
            rows.append({"group": g, "versus": orca, "ratio": est, "paper": PAPER_RATIO.get(g)
                         if orca == "Orca (Oracle)" else None})
    return rows


def _shape(trajs: tuple) -> dict:
    rounds = [len(set(kept)) for t in trajs for kept in t[1:]]
    return {"num_searches": len(trajs), "rounds": len(trajs[0]) if trajs else 0,
            "mean_distinct_parents": sum(rounds) / len(rounds) if rounds else None}


def _config_doc(cfg: BeamServingConfig) -> dict:
    doc = dataclasses.asdict(cfg)
    doc["allocators"] = [AllocatorSpec(**a).name for a in doc["allocators"]]
    return doc


def main(argv: list[str]) -> None:
    from pagedbench.bench.studies.beam import serving_report as beam_serving_report

    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench beam_serving", description=__doc__)
    parser.add_argument("--out", default=str(env_mod.RESULTS_DIR), help="output folder (default: results/)")
    parser.add_argument("--full", action="store_true", help="5 seeds, 10-minute spans, finer bisection")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    parser.add_argument("--address", default=None,
                        help="a Ray cluster's address (default: RAY_ADDRESS, else local processes)")
    args = parser.parse_args(argv)
    cfg = FULL if args.full else QUICK
    start = time.perf_counter()
    trajectories = record(cfg)
    doc = {"schema_version": records.SCHEMA_VERSION, "environment": env_mod.environment(),
           **run_study(cfg, trajectories, address=args.address)}
    doc["wall_s"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = beam_serving_report.markdown(doc)
    records.write_json(out / "beam_serving.json", doc)
    records.write_text(out / "beam_serving.md", text)
    if not args.no_plots:
        beam_serving_report.plot(doc, out)
    print(text)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
