"""One point of the serving study: a setting, dataset, policy and KV manager served at one offered rate.

:func:`run_point` draws the arrivals of a span (Poisson at ``rate`` over ``span_s`` simulated seconds),
serves them with :func:`pagedbench.bench.sim.simulator.simulate` on the cost model's step times, and
returns one flat record: the overload test, offered and achieved rates, the field's metrics over the
measured requests (``vllm bench serve``'s keys, :mod:`pagedbench.bench.common.serving_metrics`), each SLO's
attainment and ``request_goodput`` (:mod:`pagedbench.bench.common.slo`), the pool's peak use and, with
``account``, the memory shares. It runs in a worker process; finished points are cached under
``.cache/serving/`` by a hash of everything that decides them (``SIM_VERSION`` included).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pagedbench.bench import workloads
from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records
from pagedbench.bench.common.serving_metrics import request_metrics, summarize
from pagedbench.bench.common.slo import attainment, parse_slo, request_goodput, slo_met
from pagedbench.bench.costmodel import StepCostModel, load_hardware, load_model
from pagedbench.bench.sim.group_replay import GroupSpec
from pagedbench.bench.sim.settings import Dataset, Setting
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.bench.workloads import sessions, trace_formats, trace_spans

CACHE_DIR = env_mod.REPO_ROOT / ".cache" / "serving"  # PAGEDBENCH_SERVING_CACHE overrides it
SIM_VERSION = 2  # bump when the simulator's behaviour changes: cached points are then recomputed
COST_TERMS = ("step_overhead", "attention")  # the terms the sensitivity analysis scales


@dataclass(frozen=True, slots=True)
class Method:
    """How a point is measured (the same for every point of a study)."""

    span_s: float  # simulated seconds of arrivals, stretched at low rates to hold min_requests arrivals
    min_requests: int
    warmup_frac: float
    cooldown_frac: float
    overload_z: float
    max_num_seqs: int
    max_num_batched_tokens: int
    watermark: float
    slos: tuple[str, ...]
    min_window_arrivals: int = 0  # the span grows until its measured window expects this many arrivals


@dataclass(frozen=True, slots=True)
class Point:
    setting: Setting
    dataset: Dataset
    allocator: AllocatorSpec
    policy: str
    rate: float
    seed: int
    max_seq_len: int
    kv_slots: int
    account: bool
    method: Method
    cost_scale: tuple[tuple[str, float], ...] = ()  # (term, factor): the sensitivity analysis
    group: GroupSpec | None = None  # each request's n samples or beams (None: one sample)

    def key(self, cost: StepCostModel) -> str:
        point = dataclasses.asdict(self)
        if self.group is None:  # the key of a one-sample point is what it was before groups existed
            del point["group"]
        if self.setting.linear_model == "roofline":  # and of a roofline point, before the tile model
            del point["setting"]["linear_model"]
        if not self.dataset.workload:  # and of a dataset without a named workload, before those existed
            del point["dataset"]["workload"]
        parts = [SIM_VERSION, point, dataclasses.asdict(cost)]
        if self.dataset.trace:  # a trace's point follows the file's content, not its name
            parts.append(trace_spans.sha256(self.dataset.trace))
        if self.dataset.workload:  # and a named workload's, the code that generates it
            parts.append(sessions.source_sha256())
        blob = json.dumps(parts, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cost_model(setting: Setting, scale: tuple[tuple[str, float], ...] = ()) -> StepCostModel:
    """The step cost of the setting's model on its GPU (its linear layers as ``setting.linear_model`` says:
    the roofline or the tile fit), with each ``(term, factor)`` of ``scale`` applied:
    ``step_overhead`` scales the per-step overhead (not the per-layer one), ``attention`` every
    attention coefficient (decode and prefill)."""
    hardware = load_hardware(setting.hardware)
    cost = StepCostModel.from_profiles(load_model(setting.model), hardware,
                                       tensor_parallel_size=setting.tensor_parallel_size,
                                       linear=setting.linear_model)
    for term, f in scale:
        if term == "step_overhead":
            cost = dataclasses.replace(cost, fixed_s=cost.fixed_s + (f - 1) * hardware.step_overhead_s)
        elif term == "attention":
            cost = dataclasses.replace(cost, decode_attn_s_per_context_token=f * cost.decode_attn_s_per_context_token,
                                       prefill_attn_s_per_kv_token=f * cost.prefill_attn_s_per_kv_token,
                                       prefill_attn_s_per_pair=f * cost.prefill_attn_s_per_pair)
        else:
            raise ValueError(f"unknown cost term {term!r}; known: {', '.join(COST_TERMS)}")
    return cost


def step_time_fn(cost: StepCostModel):
    """The roofline as the simulator asks for it (StepShape's contexts include the chunk's own tokens)."""
    time_from_totals = cost.time_from_totals_s

    def step_time_s(shape) -> float:
        chunks = tuple((q, ctx - q) for q, ctx in shape.prefill_chunks)
        num_decode = len(shape.decode_context_lens)
        return time_from_totals(shape.num_prefill_tokens + num_decode, num_decode + len(chunks),
                                sum(shape.decode_context_lens), chunks)

    def decode_run(context_lens):
        """Step ``j`` of decode-only steps from ``context_lens`` (sim_fast_forward.decode_run_of): the same
        totals step_time_s would sum, the context growing by one token a sequence a step."""
        b, total = len(context_lens), sum(context_lens)
        return lambda j: time_from_totals(b, b, total + j * b, ())

    step_time_s.decode_run = decode_run
    return step_time_s


def span_trace(d: Dataset, rate: float, span_s: float, seed: int, max_seq_len: int) -> tuple:
    """The Poisson arrivals of ``[0, span_s)`` at ``rate`` with the dataset's lengths; for a trace, its
    requests replayed at mean ``rate`` (:func:`pagedbench.bench.workloads.trace_spans.span`); for a named
    workload, its own arrivals (:mod:`pagedbench.bench.workloads.sessions`)."""
    if d.workload:
        return sessions.workload(d.workload).span(rate, span_s, seed, max_seq_len)
    if d.trace:
        return trace_spans.span(trace_spans.load(d.trace, max_seq_len, d.over_context).requests, rate, span_s, seed)
    n = max(1, math.ceil(rate * span_s + 6 * math.sqrt(rate * span_s) + 10))  # more than the span holds
    trace = workloads.synthetic(d.dataset, n, rate=rate, seed=seed, max_seq_len=max_seq_len - d.shared_prefix_len)
    trace = tuple(r for r in trace if r.arrival_s < span_s) or trace[:1]
    if trace[0].arrival_s >= span_s:  # nothing arrived in the span: one request, at its start
        trace = (dataclasses.replace(trace[0], arrival_s=0.0),)
    if d.shared_prefix_len:  # every prompt = the shared system prompt + its own tokens
        trace = tuple(dataclasses.replace(r, prompt_len=r.prompt_len + d.shared_prefix_len) for r in trace)
    return trace


def _prompt_tokens(d: Dataset):
    """Prompt token ids: a trace's own (shared blocks where it names them: Mooncake's hash ids); else the
    shared prefix (token 1) then tokens unique to the request (its id + 2, so no two requests share a
    block past the prefix); a named workload's own."""
    if d.workload:
        return sessions.workload(d.workload).prompt_tokens
    if d.trace:
        return trace_formats.prompt_token_ids
    shared = d.shared_prefix_len
    prefix = [1] * shared

    def tokens(r) -> list[int]:
        return prefix + [r.request_id + 2] * (r.prompt_len - shared)

    return tokens


def effective_span_s(p: Point) -> float:
    """The point's span: the method's, or long enough for ``min_requests`` arrivals at a low rate, and for
    ``min_window_arrivals`` expected in the measured window (between warm-up and cool-down)."""
    m = p.method
    window = max(1.0 - m.warmup_frac - m.cooldown_frac, 1e-9)
    return max(m.span_s, m.min_requests / p.rate, m.min_window_arrivals / (p.rate * window))


def _sim_config(p: Point) -> SimConfig:
    m = p.method
    # a separate prefill step holds whole prompts: its budget must hold the longest (vLLM v0 required
    # max_num_batched_tokens >= max_model_len); the mixed policy chunks prompts to its own budget
    budget = max(m.max_num_batched_tokens, p.max_seq_len) if p.policy == "separate" else m.max_num_batched_tokens
    return SimConfig(kv_slots=p.kv_slots, max_seq_len=p.max_seq_len, watermark=m.watermark,
                     warmup_frac=m.warmup_frac, cooldown_frac=m.cooldown_frac, max_num_seqs=m.max_num_seqs,
                     max_num_batched_tokens=budget, policy=p.policy,
                     enable_prefix_caching=p.dataset.prefix_caching and p.allocator.kind == "paged",
                     span_s=effective_span_s(p), overload_z=m.overload_z, stop_on_overload=True)


def run_point(p: Point) -> dict:
    cost = cost_model(p.setting, p.cost_scale)
    cache = Path(os.environ.get("PAGEDBENCH_SERVING_CACHE", CACHE_DIR)) / f"{p.key(cost)}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    span = effective_span_s(p)
    trace = span_trace(p.dataset, p.rate, span, p.seed, p.max_seq_len)
    start = time.perf_counter()
    r = simulate(trace, p.allocator, _sim_config(p), step_time_s=step_time_fn(cost), account=p.account,
                 prompt_tokens=_prompt_tokens(p.dataset), group=p.group)
    wall = time.perf_counter() - start
    o = r.overload
    window = o.window_s[1] - o.window_s[0]
    finished = [request_metrics(t) for t in r.requests if t.finished]
    unfinished = len(r.requests) - len(finished)
    row = {"rate": p.rate, "seed": p.seed, "span_s": span, "overloaded": o.overloaded, "stopped_early": o.stopped_early,
           "offered_rate": o.offered_rate, "achieved_rate": o.achieved_rate, "num_window_arrivals": o.num_arrivals,
           "backlog_growth": o.backlog_growth, "overload_allowance": o.allowance, "window_s": list(o.window_s),
           "num_unfinished": unfinished, "simulated_s": r.simulated_s, "num_steps": r.num_steps,
           "num_preemptions": r.num_preemptions, "peak_running": r.peak_running, "mean_running": r.mean_running,
           "peak_used_slots": r.peak_used_slots, "total_slots": r.total_slots, "wall_s": wall,
           "generated_tokens": r.num_generated_tokens}
    if not o.overloaded:  # an overloaded point's latency is the run's length: not reported
        row.update(summarize(finished, window))
        row["normalized_latency_s"] = row["mean_normalized_latency_s"]
        row["slo"] = {}
        for name in p.method.slos if r.requests else ():
            slo = parse_slo(name)
            row["slo"][name] = {"met": slo_met(finished, slo, num_unfinished=unfinished),
                                "attainment": attainment(finished, slo, num_unfinished=unfinished),
                                "request_goodput": request_goodput(finished, slo, window)}
        if p.method.slos and r.requests:
            row["request_goodput"] = row["slo"][p.method.slos[0]]["request_goodput"]
    if p.account:
        row["shares"] = dataclasses.asdict(r.shares)
    records.write_json(cache, row)
    return row
