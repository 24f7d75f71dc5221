"""What paged KV management buys on a GPU, a model and a request trace: one command.

``python -m pagedbench.bench serve-sim --trace FILE --model M --gpu G [--slo PRESET] [--managers ...]``

The trace (any format :mod:`pagedbench.bench.workloads.trace_formats` reads, or a shipped trace by name) is served
by the real scheduler and each KV manager on a simulated clock (:mod:`pagedbench.bench.sim.simulator`),
with the step times of the model on the GPU (:mod:`pagedbench.bench.costmodel`) and the KV budget that
GPU leaves. Its timestamps are replayed at several time scales (below 1 compressed: a higher rate,
:func:`pagedbench.bench.workloads.arrivals.replay`), and a low-load run (the same requests, one arrival per 50
mean request durations) gives the reference latency. For each manager it reports, per time
scale, the normalized latency (end-to-end latency / output tokens, the vLLM paper's), the goodput
(requests per second that met the SLO) and the pool's peak use, and the capacity at SLO: the highest
rate of the sweep whose mean normalized latency stays under the SLO (a multiple of the low-load value,
the serving study's overload rule). Writes ``serve_sim.{md,json,png}`` to the folder it names.

Points are pure functions of their inputs, cached by hash under ``.cache/serve_sim/``, run on local
processes or on Ray (``--address`` or ``RAY_ADDRESS``: :mod:`pagedbench.bench.common.sweep_runner`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records, sweep_runner
from pagedbench.bench.costmodel import kv_slot_budget, load_hardware, load_model
from pagedbench.bench.costmodel.hardware import hardware_names
from pagedbench.bench.costmodel.models import model_names
from pagedbench.bench.sim.points import cost_model, step_time_fn
from pagedbench.bench.sim.run import default_manager
from pagedbench.bench.sim.settings import Setting
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.bench.studies.serve_sim import report as serve_sim_report
from pagedbench.bench.workloads import arrivals, trace_formats

CACHE_DIR = env_mod.REPO_ROOT / ".cache" / "serve_sim"  # PAGEDBENCH_SERVE_SIM_CACHE overrides it
POINT_VERSION = 1  # bump when a point's result changes for the same inputs
# SLOs as multiples of the low-load normalized latency (the serving study's rule; the paper's 2x line)
SLO_PRESETS = {"norm-2x": 2.0, "norm-4x": 4.0, "norm-10x": 10.0}
MANAGERS = {"paged": AllocatorSpec("paged", 16), "orca-oracle": AllocatorSpec("orca", 1, "oracle"),
            "orca-pow2": AllocatorSpec("orca", 1, "pow2"), "orca-max": AllocatorSpec("orca", 1, "max")}
DEFAULT_SCALES = (4.0, 2.0, 1.0, 0.5, 0.25, 0.125, 0.0625)
LOW_LOAD_SPACING = 50  # low load: one arrival per this many mean request durations


@dataclass(frozen=True, slots=True)
class TracePoint:
    trace: str  # path of the trace file
    trace_sha256: str  # its content's hash (the cache key follows the data, not the name)
    format: str
    over_context: str
    max_seq_len: int
    num_requests: int | None  # the first this many requests (None: all)
    time_scale: float | None  # None: the low-load run
    manager: str  # a key of MANAGERS
    model: str
    gpu: str
    kv_slots: int
    prefix_caching: bool
    latency_limit_s: float | None  # the SLO on each request's normalized latency (None: not judged)

    def key(self) -> str:
        blob = json.dumps([POINT_VERSION, dataclasses.asdict(self)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load_requests(p: TracePoint) -> trace_formats.LoadedTrace:
    loaded = trace_formats.load_trace(p.trace, format=p.format, max_seq_len=p.max_seq_len,
                                      over_context=p.over_context)
    if p.num_requests is not None:
        loaded = dataclasses.replace(loaded, requests=loaded.requests[:p.num_requests])
    return loaded


def low_load(requests, setting_cost) -> tuple:
    """The trace's requests arriving one per LOW_LOAD_SPACING mean request durations (constant gaps)."""
    mean_prompt = sum(r.prompt_len for r in requests) / len(requests)
    mean_output = sum(r.output_len for r in requests) / len(requests)
    per_token = setting_cost.time_from_totals_s(1, 1, int(mean_prompt + mean_output / 2))
    rate = 1.0 / (LOW_LOAD_SPACING * mean_output * per_token)
    return arrivals.with_arrivals(requests, arrivals.arrival_times("constant", len(requests), rate))


def run_trace_point(p: TracePoint) -> dict:
    """One simulation of the trace at ``p.time_scale`` with ``p.manager`` (cached by the point's hash)."""
    cache = Path(os.environ.get("PAGEDBENCH_SERVE_SIM_CACHE", CACHE_DIR)) / f"{p.key()}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    cost = cost_model(serving_sim_setting(p))
    requests = load_requests(p).requests
    if p.time_scale is None:
        trace = low_load(requests, cost)
    else:
        trace = arrivals.replay(requests, p.time_scale)
    spec = MANAGERS[p.manager]
    caching = p.prefix_caching and spec.kind == "paged"
    cfg = SimConfig(kv_slots=p.kv_slots, max_seq_len=p.max_seq_len, warmup_frac=0.0,
                    max_num_batched_tokens=max(4096, p.max_seq_len), enable_prefix_caching=caching)
    managers, peak = [], [0]

    def make_manager(spec, cfg):
        managers.append(default_manager(spec, cfg))
        return managers[-1]

    def on_step() -> None:  # blocks only grow inside a fast-forwarded run: its end holds its peak
        peak[0] = max(peak[0], managers[0].num_used_blocks)

    result = simulate(trace, spec, cfg, step_time_s=step_time_fn(cost), account=False,
                      prompt_tokens=trace_formats.prompt_token_ids, on_step=on_step, make_manager=make_manager)
    row = {"time_scale": p.time_scale, "rate_rps": arrivals.mean_rate(trace),
           "peak_pool_use": peak[0] / managers[0].num_blocks, "num_preemptions": result.num_preemptions,
           **serve_sim_report.metrics(trace, result, p.latency_limit_s)}
    records.write_json(cache, row)
    return row


def serving_sim_setting(p: TracePoint) -> Setting:
    return Setting(f"{p.model}@{p.gpu}", p.model, p.gpu, p.max_seq_len)


def trace_path(name_or_path: str) -> Path:
    return trace_formats.SHIPPED.get(name_or_path) or Path(name_or_path)


def run(args: argparse.Namespace) -> dict:
    path = trace_path(args.trace)
    loaded = trace_formats.load_trace(path, format=args.format, max_seq_len=args.max_seq_len,
                                      over_context=args.over_context)  # bad input fails before any work
    served = loaded.requests[:args.requests]
    if len(served) < 2 or served[-1].arrival_s <= served[0].arrival_s:
        raise trace_formats.TraceFormatError(f"{path}: the {len(served)} requests served all arrive at once: "
                                             "no rate to sweep (serve more of them with --requests)")
    budget = kv_slot_budget(load_model(args.model), load_hardware(args.gpu))
    base = TracePoint(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), loaded.format, args.over_context,
                      args.max_seq_len, args.requests, None, "paged", args.model, args.gpu, budget.num_slots,
                      args.prefix_caching, None)
    run_points = lambda pts: sweep_runner.map_points(run_trace_point, pts, workers=args.workers,  # noqa: E731
                                                     address=args.address)
    (low,) = run_points([base])
    limit = SLO_PRESETS[args.slo] * low["mean_normalized_latency_s"]
    points = [dataclasses.replace(base, time_scale=s, manager=m, latency_limit_s=limit)
              for m in args.managers for s in args.scales]
    rows = run_points(points)
    results = {m: [{"time_scale": p.time_scale, **r} for p, r in zip(points, rows) if p.manager == m]
               for m in args.managers}
    return {"trace": {"path": str(path), "format": loaded.format, "num_requests": len(served),
                      "num_rows": loaded.num_rows, "over_context": args.over_context,
                      "num_dropped": loaded.num_dropped, "num_clipped": loaded.num_clipped,
                      "num_empty": loaded.num_empty, "max_seq_len": args.max_seq_len},
            "model": args.model, "gpu": args.gpu, "kv_slots": budget.num_slots, "slo": args.slo,
            "latency_limit_s": limit, "low_load": low, "results": results,
            "capacity_rps": {m: serve_sim_report.capacity(rs) for m, rs in results.items()}}


def _parser() -> argparse.ArgumentParser:
    epilog = "\n".join([
        "shipped traces: " + ", ".join(trace_formats.SHIPPED), "GPUs: " + ", ".join(hardware_names()),
        "models: " + ", ".join(model_names()),
        "SLO presets: " + ", ".join(f"{k} (normalized latency <= {v:g}x low load)" for k, v in SLO_PRESETS.items()),
        "KV managers: " + ", ".join(MANAGERS), "trace formats: " + ", ".join(trace_formats.FORMATS)])
    p = argparse.ArgumentParser(prog="python -m pagedbench.bench serve-sim", description=__doc__, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="a trace file, or a shipped trace's name")
    p.add_argument("--format", choices=trace_formats.FORMATS, help="the trace's format (default: sniffed)")
    p.add_argument("--model", required=True, choices=model_names())
    p.add_argument("--gpu", required=True, choices=hardware_names())
    p.add_argument("--slo", default="norm-2x", choices=list(SLO_PRESETS))
    p.add_argument("--managers", nargs="+", default=list(MANAGERS), choices=list(MANAGERS))
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="the longest request served (default: the model's context, max_position_embeddings)")
    p.add_argument("--over-context", default="error", choices=trace_formats.OVER_CONTEXT,
                   help="requests longer than the context: error (default), drop or clip")
    p.add_argument("--requests", type=int, help="serve the first N requests only")
    p.add_argument("--scales", type=float, nargs="+", default=list(DEFAULT_SCALES),
                   help="time scales of the sweep (below 1: compressed, a higher rate)")
    p.add_argument("--prefix-caching", action="store_true", help="the paged manager's prefix cache")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--address", help="a Ray cluster's address (default: RAY_ADDRESS, else local processes)")
    p.add_argument("--out", help="output folder (default: results/serve_sim/<trace>_<model>_<gpu>)")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    context = load_model(args.model).max_position_embeddings
    if args.max_seq_len is None:
        args.max_seq_len = context
    elif not 1 <= args.max_seq_len <= context:
        raise SystemExit(f"serve-sim: --max-seq-len must be in [1, {context}] ({args.model}'s context), "
                         f"got {args.max_seq_len}")
    if args.requests is not None and args.requests < 1:
        raise SystemExit(f"serve-sim: --requests must be >= 1, got {args.requests}")
    if any(s <= 0 for s in args.scales):
        raise SystemExit(f"serve-sim: --scales must be > 0, got {args.scales}")
    try:
        start = time.perf_counter()
        doc = {"schema_version": records.SCHEMA_VERSION, "environment": env_mod.environment(), **run(args)}
    except trace_formats.TraceFormatError as e:
        raise SystemExit(f"serve-sim: {e}") from None
    doc["wall_s"] = time.perf_counter() - start
    name = f"{Path(doc['trace']['path']).stem}_{args.model}_{args.gpu}"
    out = Path(args.out) if args.out else env_mod.RESULTS_DIR / "serve_sim" / name
    text = serve_sim_report.markdown(doc)
    records.write_json(out / "serve_sim.json", doc)
    records.write_text(out / "serve_sim.md", text)
    if not args.no_plots:
        serve_sim_report.plot(doc, out / "serve_sim.png")
    print(text)
    print(f"\nwritten to {out}/")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
