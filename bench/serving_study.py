"""The serving study: what paging buys a serving system (the vLLM paper's Fig. 12, 2 and 13).

``python -m pagedbench.bench --only serving_study [--full]`` (config ``bench/configs/serving.yaml``).
For each setting (a model on a GPU, from the step-cost model's profiles), dataset, scheduler policy and
KV manager (Orca Max / Pow2 / Oracle, paged), the real scheduler serves a Poisson trace on a simulated
clock (:mod:`pagedbench.bench.serving_sim`) whose step times come from the roofline
(:mod:`pagedbench.bench.costmodel`), and the *capacity* is found: the highest request rate whose
normalized latency (mean end-to-end latency / output tokens) stays below a threshold times the low-load
value, by bracketing and geometric bisection. Every simulation is independent: they run in parallel
processes, and finished points are cached (``.cache/serving/``) so a re-run resumes. Writes
``results/serving.{json,md}`` and ``results/serving_*.png``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
from pagedbench.bench import environment as env_mod
from pagedbench.bench import records, workloads
from pagedbench.bench.costmodel import StepCostModel, kv_slot_budget, load_hardware, load_model
from pagedbench.bench.serving_sim import AllocatorSpec, SimConfig, simulate

CONFIG = Path(__file__).resolve().parent / "configs" / "serving.yaml"
CACHE_DIR = env_mod.REPO_ROOT / ".cache" / "serving"  # PAGEDBENCH_SERVING_CACHE overrides it
SIM_VERSION = 1  # bump when the simulator's behaviour changes: cached points are then recomputed
_KEYS = {"settings", "datasets", "allocators", "policies", "policy_comparison_settings", "max_num_seqs",
         "max_num_batched_tokens", "watermark", "gpu_memory_utilization", "thresholds", "low_load_requests",
         "bisection_steps", "seeds", "memory_points", "workers", "full"}


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    model: str
    hardware: str
    max_seq_len: int


@dataclass(frozen=True, slots=True)
class Dataset:
    name: str
    dataset: str
    num_requests: int
    shared_prefix_len: int = 0  # tokens of a system prompt every request starts with
    prefix_caching: bool = False  # the paged manager's prefix cache (Orca cannot share)
    max_seq_len: int | None = None  # overrides the setting's (long contexts)
    settings: tuple[str, ...] | None = None  # the settings it runs on (None: all)
    kinds: tuple[str, ...] | None = None  # the KV manager kinds it runs with (None: all)
    compare_policies: bool = True  # run every scheduler policy (on the comparison settings)

    def runs_on(self, setting: Setting) -> bool:
        return self.settings is None or setting.name in self.settings

    def max_len(self, setting: Setting) -> int:
        return self.max_seq_len or setting.max_seq_len


@dataclass(frozen=True, slots=True)
class StudyConfig:
    settings: tuple[Setting, ...]
    datasets: tuple[Dataset, ...]
    allocators: tuple[AllocatorSpec, ...]
    policies: tuple[str, ...]
    policy_comparison_settings: tuple[str, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    watermark: float
    gpu_memory_utilization: float
    thresholds: tuple[float, ...]
    low_load_requests: int
    bisection_steps: int
    seeds: tuple[int, ...]
    memory_points: tuple[tuple[str, float], ...]
    workers: int


def load_config(path: str | Path = CONFIG, *, full: bool = False) -> StudyConfig:
    """The study's config; an unknown or missing key, or a bad value, names the file and the key."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    unknown = set(doc) - _KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    if full:
        doc = {**doc, **(doc.get("full") or {})}
    try:
        cfg = StudyConfig(
            settings=tuple(Setting(**s) for s in doc["settings"]),
            datasets=tuple(Dataset(**{**d, **{k: tuple(d[k]) for k in ("settings", "kinds") if d.get(k)}})
                           for d in doc["datasets"]),
            allocators=tuple(AllocatorSpec(**a) for a in doc["allocators"]),
            policies=tuple(doc["policies"]),
            policy_comparison_settings=tuple(doc["policy_comparison_settings"]),
            max_num_seqs=int(doc["max_num_seqs"]), max_num_batched_tokens=int(doc["max_num_batched_tokens"]),
            watermark=float(doc["watermark"]), gpu_memory_utilization=float(doc["gpu_memory_utilization"]),
            thresholds=tuple(float(t) for t in doc["thresholds"]),
            low_load_requests=int(doc["low_load_requests"]), bisection_steps=int(doc["bisection_steps"]),
            seeds=tuple(int(s) for s in doc["seeds"]),
            memory_points=tuple((m["dataset"], float(m["rate"])) for m in doc["memory_points"]),
            workers=int(doc["workers"]))
    except KeyError as e:
        raise ValueError(f"{path}: missing key {e.args[0]!r}") from None
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None
    for d in cfg.datasets:
        if d.dataset not in workloads.DATASETS or d.num_requests < 1:
            raise ValueError(f"{path}: dataset {d.name!r}: unknown dataset or num_requests < 1")
    if any(t <= 1 for t in cfg.thresholds) or cfg.bisection_steps < 0 or cfg.workers < 1:
        raise ValueError(f"{path}: thresholds must be > 1, bisection_steps >= 0, workers >= 1")
    return cfg


# --- one simulation (runs in a worker process) -----------------------------------------------------------
def step_time_fn(cost: StepCostModel):
    """The roofline as the simulator asks for it (StepShape's contexts include the chunk's own tokens)."""
    time_from_totals = cost.time_from_totals_s

    def step_time_s(shape) -> float:
        chunks = tuple((q, ctx - q) for q, ctx in shape.prefill_chunks)
        num_decode = len(shape.decode_context_lens)
        return time_from_totals(shape.num_prefill_tokens + num_decode, num_decode + len(chunks),
                                sum(shape.decode_context_lens), chunks)

    return step_time_s


@dataclass(frozen=True, slots=True)
class Point:
    setting: Setting
    dataset: Dataset
    allocator: AllocatorSpec
    policy: str
    rate: float
    seed: int
    num_requests: int
    kv_slots: int
    account: bool
    cfg: tuple  # (max_num_seqs, max_num_batched_tokens, watermark)

    def key(self, cost: StepCostModel) -> str:
        blob = json.dumps([SIM_VERSION, dataclasses.asdict(self), dataclasses.asdict(cost)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cost_model(setting: Setting) -> StepCostModel:
    return StepCostModel.from_profiles(load_model(setting.model), load_hardware(setting.hardware))


def run_point(p: Point) -> dict:
    cost = cost_model(p.setting)
    cache = Path(os.environ.get("PAGEDBENCH_SERVING_CACHE", CACHE_DIR)) / f"{p.key(cost)}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    d = p.dataset
    max_len = d.max_len(p.setting)
    trace = workloads.synthetic(d.dataset, p.num_requests, rate=p.rate, seed=p.seed,
                                max_seq_len=max_len - d.shared_prefix_len)
    if d.shared_prefix_len:  # every prompt = the shared system prompt + its own tokens
        trace = tuple(dataclasses.replace(r, prompt_len=r.prompt_len + d.shared_prefix_len) for r in trace)
    max_num_seqs, budget, watermark = p.cfg
    # memory shares are measured over the arrival window (warm-up excluded); latency over every request
    warmup = 0.1 if p.account else 0.0
    caching = d.prefix_caching and p.allocator.kind == "paged"
    sim = SimConfig(kv_slots=p.kv_slots, max_seq_len=max_len, watermark=watermark, warmup_frac=warmup,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max(budget, max_len), policy=p.policy,
                    enable_prefix_caching=caching)
    start = time.perf_counter()
    r = simulate(trace, p.allocator, sim, step_time_s=step_time_fn(cost), account=p.account,
                 prompt_tokens=_prompt_tokens(d.shared_prefix_len))
    wall = time.perf_counter() - start
    outputs = sum(t.output_len for t in trace)
    row = {"rate": p.rate, "seed": p.seed, "normalized_latency_s": r.mean_normalized_latency_s,
           "mean_latency_s": sum(r.latencies_s) / len(r.latencies_s), "simulated_s": r.simulated_s,
           "output_tokens_per_s": outputs / r.simulated_s, "num_steps": r.num_steps,
           "num_preemptions": r.num_preemptions, "peak_running": r.peak_running,
           "mean_running": r.mean_running, "wall_s": wall, "generated_tokens": r.num_generated_tokens,
           "tokens_per_wall_s": r.num_generated_tokens / wall}
    if p.account:
        row["shares"] = dataclasses.asdict(r.shares)
    records.write_json(cache, row)
    return row


def _prompt_tokens(shared: int):
    """Prompt token ids: the shared prefix (token 1) then tokens unique to the request (its id + 2, so
    no two requests share a block past the prefix)."""
    prefix = [1] * shared

    def tokens(r) -> list[int]:
        return prefix + [r.request_id + 2] * (r.prompt_len - shared)

    return tokens


# --- the capacity search -------------------------------------------------------------------------------
def _low_load_rate(setting: Setting, dataset: Dataset) -> float:
    """A rate at which requests hardly ever overlap: one arrival per 50 mean request durations."""
    cost = cost_model(setting)
    stats = workloads.DATASETS[dataset.dataset]
    ctx = stats.mean_prompt + stats.mean_output / 2
    per_token = cost.time_from_totals_s(1, 1, int(ctx))
    return 1.0 / (50 * stats.mean_output * per_token)


def find_capacity(base: Point, low_load: float, thresholds: tuple[float, ...], steps: int) -> dict:
    """Capacity under each threshold (rate, req/s) and every point evaluated, for one search."""
    evaluated: dict[float, dict] = {}

    def lat(rate: float) -> float:
        if rate not in evaluated:
            evaluated[rate] = run_point(dataclasses.replace(base, rate=rate))
        return evaluated[rate]["normalized_latency_s"]

    limits = [t * low_load for t in thresholds]
    rate = 4 * base.rate  # base.rate: the low-load rate
    while lat(rate) <= max(limits) and rate < 1e6:
        rate *= 4  # coarse: the bisection below refines inside the bracket
    capacities, unsaturated = {}, []
    for t, limit in zip(thresholds, limits):
        below = [r for r in evaluated if evaluated[r]["normalized_latency_s"] <= limit]
        above = [r for r in evaluated if evaluated[r]["normalized_latency_s"] > limit]
        lo = max(below) if below else 0.0
        if not any(r > lo for r in above):  # never saturated within the bracket: a lower bound only
            capacities[str(t)] = lo
            unsaturated.append(str(t))
            continue
        hi = min(r for r in above if r > lo)
        for _ in range(steps):
            mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
            if lat(mid) <= limit:
                lo = mid
            else:
                hi = mid
        capacities[str(t)] = lo
    points = [{"rate": r, **{k: v for k, v in row.items() if k != "rate"}} for r, row in sorted(evaluated.items())]
    # a threshold never crossed (the whole trace fits the KV pool at once) gives a lower bound only
    return {"capacity": capacities, "lower_bound_only": unsaturated, "points": points}


def _search(args) -> dict:
    base, low_load, thresholds, steps = args
    allocator = base.allocator.name + (" + prefix cache" if base.dataset.prefix_caching
                                       and base.allocator.kind == "paged" else "")
    return {"setting": base.setting.name, "dataset": base.dataset.name, "allocator": allocator,
            "policy": base.policy, "seed": base.seed, "low_load_normalized_latency_s": low_load,
            **find_capacity(base, low_load, thresholds, steps)}


def run_study(cfg: StudyConfig, *, progress: bool = True) -> dict:
    cfg_tuple = (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.watermark)
    slots = {s.name: kv_slot_budget(load_model(s.model), load_hardware(s.hardware), cfg.gpu_memory_utilization)
             for s in cfg.settings}
    paged = next(a for a in cfg.allocators if a.kind == "paged")
    low_jobs, searches = [], []
    for s in cfg.settings:
        compare = s.name in cfg.policy_comparison_settings
        for d in (d for d in cfg.datasets if d.runs_on(s)):
            for policy in cfg.policies if compare and d.compare_policies else cfg.policies[:1]:
                for seed in cfg.seeds:
                    rate = _low_load_rate(s, d)
                    low = Point(s, d, paged, policy, rate, seed, cfg.low_load_requests, slots[s.name].num_slots,
                                False, cfg_tuple)
                    low_jobs.append(low)
                    searches += [(dataclasses.replace(low, allocator=a, num_requests=d.num_requests))
                                 for a in cfg.allocators if d.kinds is None or a.kind in d.kinds]
    with ProcessPoolExecutor(cfg.workers) as pool:
        lows = dict(zip([(p.setting.name, p.dataset.name, p.policy, p.seed) for p in low_jobs],
                        pool.map(run_point, low_jobs)))
        jobs = [(b, lows[(b.setting.name, b.dataset.name, b.policy, b.seed)]["normalized_latency_s"],
                 cfg.thresholds, cfg.bisection_steps) for b in searches]
        results = []
        for i, res in enumerate(pool.map(_search, jobs), 1):
            results.append(res)
            if progress:
                print(f"  [{i}/{len(jobs)}] {res['setting']} {res['dataset']} {res['policy']} {res['allocator']}: "
                      f"capacity {res['capacity']} req/s", flush=True)
        first = cfg.settings[0]
        mem_jobs = [Point(first, next(d for d in cfg.datasets if d.name == ds), a, cfg.policies[0], rate,
                          cfg.seeds[0], next(d for d in cfg.datasets if d.name == ds).num_requests,
                          slots[first.name].num_slots, True, cfg_tuple)
                    for ds, rate in cfg.memory_points for a in cfg.allocators]
        memory = [{"setting": p.setting.name, "dataset": p.dataset.name, "allocator": p.allocator.name, **row}
                  for p, row in zip(mem_jobs, pool.map(run_point, mem_jobs))]
    prices = {s.name: load_hardware(s.hardware).price_per_gpu_hour_usd for s in cfg.settings}
    return {"config": dataclasses.asdict(cfg), "kv_slots": {k: {"num_slots": v.num_slots, "derivation": v.lines()}
                                                            for k, v in slots.items()},
            "cost_models": {s.name: dataclasses.asdict(cost_model(s)) for s in cfg.settings},
            "prices_usd_per_gpu_hour": prices, "searches": results, "memory": memory}


def main(argv: list[str]) -> None:
    from pagedbench.bench import serving_report

    parser = records.study_parser("python -m pagedbench.bench.serving_study", __doc__, CONFIG, env_mod.RESULTS_DIR)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, full=args.full)
    start = time.perf_counter()
    doc = {"schema_version": records.SCHEMA_VERSION, "environment": env_mod.environment(), **run_study(cfg)}
    doc["wall_s"] = time.perf_counter() - start
    out = Path(args.out)
    text = serving_report.markdown(doc)
    records.write_json(out / "serving.json", doc)
    records.write_text(out / "serving.md", text)
    if not args.no_plots:
        serving_report.plot(doc, out)
    print(text)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
