"""The serving study: what paging buys a serving system (the vLLM paper's Fig. 12, 2 and 13), measured
as the field measures serving today.

``python -m pagedbench.bench --only serving_study [--full]`` (config ``bench/configs/serving.yaml``).
For each setting (a model on a GPU, at the model's context unless the config says less), dataset,
scheduler policy, KV manager (Orca Max / Pow2 / Oracle, paged) and seed, the real scheduler serves the
Poisson arrivals of a simulated span on the cost model's step times (:mod:`pagedbench.bench.sim.points`),
and capacities are searched (:mod:`pagedbench.bench.sim.capacity_search`):

- at each latency threshold: the highest rate whose normalized latency (mean E2E / output tokens, the
  paper's metric) stays below threshold x the low-load value;
- at each SLO (:mod:`pagedbench.bench.common.slo`): the highest rate at which the SLO holds (DistServe's goodput);

a point that is overloaded (its backlog grew across the measured window by more than ``overload_z``
standard deviations of its arrivals: :mod:`pagedbench.bench.sim.simulator`) fails every criterion, so no
capacity comes from a plateau. The *saturation throughput*, threshold-free, is the highest achieved
rate seen in the search (an overloaded point serves at the system's limit). Over the seeds each
capacity gets a 95% interval; the report calls overlapping intervals a tie. Fig. 2/13 come from span
runs at the paper's rates; the sensitivity runs repeat one search with the per-step overhead and the
attention terms at each factor. Every simulation is independent: they run in parallel processes (or on a
Ray cluster: ``--address`` or ``RAY_ADDRESS``), and finished points are cached (``.cache/serving/``) so a
re-run resumes. Writes ``results/serving.{json,md}`` and ``results/serving_*.png``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records, sweep_runner
from pagedbench.bench.costmodel import kv_slot_budget, load_hardware, load_model
from pagedbench.bench.sim.capacity_search import relative_half_width
from pagedbench.bench.sim.points import SIM_VERSION, Method, Point, cost_model, run_point
from pagedbench.bench.sim.serving_search import criteria, low_load_rate, replicate_key, search
from pagedbench.bench.sim.settings import Dataset, Setting
from pagedbench.bench.studies.serving import precision as serving_precision
from pagedbench.bench.studies.serving.config import CONFIG, StudyConfig, load_config
from pagedbench.bench.workloads import arrivals, trace_spans

__all__ = ["CONFIG", "SIM_VERSION", "load_config", "main", "run_study"]


def trace_record(setting: Setting, dataset: Dataset, max_seq_len: int) -> dict:
    """What a trace dataset served on a setting: its requests, those dropped or clipped at
    ``max_seq_len``, their mean lengths and the trace's own mean rate."""
    t = trace_spans.load(dataset.trace, max_seq_len, dataset.over_context)
    prompt, output = trace_spans.mean_lengths(dataset.trace, max_seq_len, dataset.over_context)
    return {"setting": setting.name, "dataset": dataset.name, "trace": dataset.trace,
            "sha256": trace_spans.sha256(dataset.trace), "format": t.format, "max_seq_len": max_seq_len,
            "over_context": t.over_context, "num_rows": t.num_rows, "num_served": len(t.requests),
            "num_dropped": t.num_dropped, "num_clipped": t.num_clipped, "mean_prompt": prompt, "mean_output": output,
            "trace_rate_rps": arrivals.mean_rate(t.requests)}


def _search_job(args) -> dict:
    return search(*args)


def _method(cfg: StudyConfig, span_s: float) -> Method:
    return Method(span_s, cfg.low_load_requests, cfg.warmup_frac, cfg.cooldown_frac, cfg.overload_z, cfg.max_num_seqs,
                  cfg.max_num_batched_tokens, cfg.watermark, cfg.slos, cfg.min_window_arrivals)


def plan(cfg: StudyConfig, slots: dict) -> tuple[list[Point], list[Point], list[Point]]:
    """The low-load points, the search bases (rate = the low-load rate), and the memory points."""
    lows, bases = [], []
    allocs = cfg.allocators
    scales = [()]
    if cfg.sensitivity:
        scales += [((term, f),) for term in cfg.sensitivity.terms for f in cfg.sensitivity.factors]
    for s in cfg.settings:
        for d in (d for d in cfg.datasets if d.runs_on(s)):
            msl = cfg.max_seq_len(s, d)
            for policy in cfg.policies_for(s, d):
                for scale in scales:
                    sens = cfg.sensitivity
                    if scale and not (sens.setting == s.name and sens.dataset == d.name and sens.policy == policy):
                        continue
                    for seed in cfg.seeds[:1] if scale else cfg.seeds:
                        rate = low_load_rate(s, d, msl)
                        paged = next(a for a in allocs if a.kind == "paged")
                        # at the low-load rate the span stretches to hold low_load_requests arrivals
                        low = Point(s, d, paged, policy, rate, seed, msl, slots[s.name], False,
                                    _method(cfg, cfg.span(s, d)), scale)
                        lows.append(low)
                        bases += [dataclasses.replace(low, allocator=a)
                                  for a in allocs if d.kinds is None or a.kind in d.kinds]
    first = cfg.settings[0]
    memory = []
    for ds, rate, policy in cfg.memory_points:
        d = next(d for d in cfg.datasets if d.name == ds)
        memory += [Point(first, d, a, policy, rate, cfg.seeds[0], cfg.max_seq_len(first, d),
                         slots[first.name], True, _method(cfg, cfg.span(first, d))) for a in allocs]
    return lows, bases, memory


def more_replicates(cfg: StudyConfig, lows: list[Point], bases: list[Point], results: list[dict],
                    names: list[str]) -> tuple[list[Point], list[Point], dict]:
    """The next round's low-load points and search bases (new seeds, for the groups whose headlines are
    wider than ``cfg.target_half_width``), and every group's precision record as it stands."""
    cap = max(cfg.max_seeds, len(cfg.seeds))
    by_group = serving_precision.groups(results)
    new_lows, new_bases, record = [], [], {}
    for key, by_alloc in by_group.items():
        estimates, reasons = serving_precision.headlines(by_alloc, names)
        seeds = sorted({r["seed"] for runs in by_alloc.values() for r in runs})
        adaptive = key[3] == "[]" and (cfg.precision_settings is None or key[0] in cfg.precision_settings)
        want = serving_precision.replicates_wanted(estimates, len(seeds), cfg.target_half_width,
                                                   cap if adaptive else len(seeds))
        widest = max((relative_half_width(e) for e in estimates.values()), default=None)
        within = widest is not None and widest <= cfg.target_half_width
        record[" | ".join(key)] = {
            "num_replicates": len(seeds), "widest_half_width": widest, "within_target": within,
            "capped": not within and not want > len(seeds),
            "cap_reason": "" if within or want > len(seeds) else (
                _cap_reason(cap, estimates, len(seeds), cfg.target_half_width) if adaptive else
                "a sensitivity run: one seed by design" if key[3] != "[]" else
                "replicates are added only for precision_settings in this run (make bench-full adds them for all)"),
            "no_estimate": reasons}
        if want > len(seeds):
            extra = range(max(seeds) + 1, max(seeds) + 1 + want - len(seeds))
            template_lows = [p for p in lows if _low_key(p)[:3] == key[:3] and not p.cost_scale]
            template_bases = [b for b in bases if (b.setting.name, b.dataset.name, b.policy) == key[:3]
                              and not b.cost_scale and b.seed == template_lows[0].seed]
            for seed in extra:
                new_lows.append(dataclasses.replace(template_lows[0], seed=seed))
                new_bases += [dataclasses.replace(b, seed=seed) for b in template_bases]
    return new_lows, new_bases, record


def _cap_reason(cap: int, estimates: dict, num_replicates: int, target: float) -> str:
    """Why a group stopped at the cap, with what its widest headline would need at this span."""
    found = serving_precision.widest(estimates)
    need = found and serving_precision.replicates_needed(found[1], num_replicates, target)
    if not need:
        return f"the replicate cap ({cap}) was reached"
    return (f"the replicate cap ({cap}) was reached; its widest headline ({found[0]}, +-{found[1]:.0%}) would "
            f"need about {need} replicates at this span (a half-width shrinks as 1/sqrt(replicates); the longer "
            f"spans of make bench-full narrow each replicate's spread)")


def replicate_guesses(results: list[dict]) -> dict[tuple, dict[str, float]]:
    """Per KV manager of a group and criterion, the geometric mean of the capacities its replicates
    found so far: where a new replicate's search starts (a guess only: it still brackets and bisects)."""
    found: dict[tuple, dict[str, list[float]]] = {}
    for r in results:
        for c, cap in r["capacity"].items():
            if cap:
                found.setdefault(replicate_key(r), {}).setdefault(c, []).append(cap)
    return {k: {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in by_c.items()} for k, by_c in found.items()}


def _low_key(p: Point) -> tuple:
    return p.setting.name, p.dataset.name, p.policy, p.seed, p.cost_scale


def run_study(cfg: StudyConfig, *, progress: bool = True, address: str | None = None) -> dict:
    """Every point of ``cfg`` (module docstring) on ``cfg.workers`` local processes, or on the Ray cluster at
    ``address`` (or ``RAY_ADDRESS``; :mod:`pagedbench.bench.common.sweep_runner`)."""
    slots = {s.name: kv_slot_budget(load_model(s.model), load_hardware(s.hardware), cfg.gpu_memory_utilization,
                                    tensor_parallel_size=s.tensor_parallel_size) for s in cfg.settings}
    lows, bases, mem_jobs = plan(cfg, {k: v.num_slots for k, v in slots.items()})
    lows_all, bases_all = list(lows), list(bases)
    names = criteria(cfg.thresholds, cfg.slos)
    run = {"workers": cfg.workers, "address": address}
    low_rows: dict = {}
    results: list[dict] = []
    precision: dict = {}
    round_no = 0
    while lows:  # round 0: every base at the config's seeds; later rounds: more replicates where wanted
        low_rows.update(zip(map(_low_key, lows), sweep_runner.map_points(run_point, lows, **run)))
        guesses = replicate_guesses(results)
        jobs = [(b, low_rows[_low_key(b)]["normalized_latency_s"], names, cfg.bisection_steps,
                 cfg.capacity_resolution, guesses.get(replicate_key(b))) for b in bases]
        for i, res in enumerate(sweep_runner.imap_points(_search_job, jobs, **run), 1):
            results.append(res)
            if progress:
                caps = {k: (f"{v:.3g}" if v else "none") for k, v in res["capacity"].items()}
                print(f"  [{round_no}: {i}/{len(jobs)}] {res['setting']} {res['dataset']} {res['policy']} "
                      f"{res['allocator']} seed {res['seed']} {res['cost_scale'] or ''}: capacity {caps} req/s",
                      flush=True)
        lows, bases, precision = more_replicates(cfg, lows_all, bases_all, results, names)
        lows_all += lows
        bases_all += bases
        round_no += 1
    mem_rows = sweep_runner.map_points(run_point, mem_jobs, **run)
    memory = [{"setting": p.setting.name, "dataset": p.dataset.name, "allocator": p.allocator.name,
               "policy": p.policy, **row} for p, row in zip(mem_jobs, mem_rows)]
    # a replica of the model costs its GPUs' hours: tokens per dollar compare settings of any size
    prices = {s.name: load_hardware(s.hardware).price_per_gpu_hour_usd * s.tensor_parallel_size for s in cfg.settings}
    settings = {s.name: {"model": s.model, "hardware": s.hardware, "note": s.note,
                         "tensor_parallel_size": s.tensor_parallel_size,
                         "context": load_model(s.model).max_position_embeddings} for s in cfg.settings}
    traces = [trace_record(s, d, cfg.max_seq_len(s, d)) for s in cfg.settings for d in cfg.datasets
              if d.trace and d.runs_on(s)]
    return {"config": dataclasses.asdict(cfg), "sim_version": SIM_VERSION, "settings": settings, "traces": traces,
            "kv_slots": {k: {"num_slots": v.num_slots, "derivation": v.lines()} for k, v in slots.items()},
            "cost_models": {s.name: dataclasses.asdict(cost_model(s)) for s in cfg.settings},
            "prices_usd_per_gpu_hour": prices, "criteria": names, "searches": results, "memory": memory,
            "precision": precision}


def main(argv: list[str]) -> None:
    from pagedbench.bench.studies.serving import report as serving_report

    parser = records.study_parser("python -m pagedbench.bench serving_study", __doc__, CONFIG, env_mod.RESULTS_DIR)
    parser.add_argument("--address", default=None,
                        help="a Ray cluster's address (default: RAY_ADDRESS, else local processes)")
    parser.add_argument("--render-only", action="store_true",
                        help="re-render serving.md (and the plots) from the serving.json in --out; simulate nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.render_only:  # the report's wording changed, the record did not
        doc = json.loads((out / "serving.json").read_text())
        records.write_text(out / "serving.md", serving_report.markdown(doc))
        if not args.no_plots:
            serving_report.plot(doc, out)
        return
    cfg = load_config(args.config, full=args.full)  # every bad value stops here, before anything is written
    start = time.perf_counter()
    doc = {"schema_version": records.SCHEMA_VERSION, "environment": env_mod.environment(),
           **run_study(cfg, address=args.address)}
    doc["wall_s"] = time.perf_counter() - start
    # rendered from the record as it reads back (tuples as lists), so --render-only gives the same page
    text = serving_report.markdown(json.loads(json.dumps(doc)))
    records.write_json(out / "serving.json", doc)
    records.write_text(out / "serving.md", text)
    if not args.no_plots:
        serving_report.plot(doc, out)
    print(text)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
