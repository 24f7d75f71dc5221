"""One decomposition run: the serving study's Fig. 2/13 point with a set of :class:`~.knobs.Knobs`,
simulated once per seed (the real scheduler on the step-cost model's clock, :mod:`pagedbench.bench.sim`).

The point is built as the serving study builds its memory points (:class:`~pagedbench.bench.sim.points.Point`
with its :class:`~pagedbench.bench.sim.points.Method`), so the default row is the serving study's own
paged ShareGPT row (same arrivals per seed); only a knob's field moves. The heavier output tail redraws
the output lengths of the same arrivals from a log-normal of shape ``output_sigma`` whose clipped mean is
the dataset's (337.99 on ShareGPT): the mean load stays, its spread grows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from pagedbench.bench import workloads
from pagedbench.bench.sim import points as sim_points
from pagedbench.bench.sim.points import Method, Point, cost_model, span_trace, step_time_fn
from pagedbench.bench.sim.records import AllocatorSpec, SimConfig
from pagedbench.bench.sim.settings import Dataset, Setting
from pagedbench.bench.sim.simulator import simulate
from pagedbench.bench.studies.batch_gap.knobs import Knobs
from pagedbench.bench.studies.batch_gap.shares import read_pool
from pagedbench.bench.workloads.datasets import _calibrated_lognormal


@dataclass(frozen=True, slots=True)
class Job:
    """One simulation: a row's knobs on the serving setting, at one seed (picklable for the workers)."""

    row: str
    knobs: Knobs
    setting: Setting
    dataset: Dataset
    kv_slots: int
    max_seq_len: int
    seed: int
    overload_z: float


def point_of(job: Job) -> Point:
    """The serving study's point for ``job`` (its memory point, with the knobs' values)."""
    k = job.knobs
    method = Method(k.span_s, 0, k.window[0], k.window[1], job.overload_z, k.max_num_seqs, k.max_num_batched_tokens,
                    k.watermark, ())
    return Point(job.setting, job.dataset, AllocatorSpec("paged", k.block_size), k.policy, k.rate, job.seed,
                 job.max_seq_len, job.kv_slots, True, method, k.cost_scale)


def sim_config_of(point: Point) -> SimConfig:
    """The simulator's config exactly as the serving study builds it for ``point``."""
    return sim_points._sim_config(point)


def heavier_tail(trace: tuple, dataset: str, sigma: float, seed: int, max_seq_len: int) -> tuple:
    """``trace`` with its output lengths redrawn from a log-normal of shape ``sigma`` whose mean (after
    clipping, each request fitting ``max_seq_len``) is ``dataset``'s published mean output."""
    rng = np.random.default_rng(seed + 7919)  # its own stream: the arrivals and prompts stay the seed's
    stats = workloads.DATASETS[dataset]
    outputs = _calibrated_lognormal(rng, max(len(trace), 20_000), stats.mean_output, sigma, max_seq_len - 1)
    return tuple(dataclasses.replace(r, output_len=int(max(1, min(o, max_seq_len - r.prompt_len))))
                 for r, o in zip(trace, outputs))


def run_job(job: Job) -> dict:
    """Simulates ``job`` and returns its record: the pool reading, the rates, the step and output means."""
    p = point_of(job)
    span = sim_points.effective_span_s(p)
    trace = span_trace(p.dataset, p.rate, span, p.seed, p.max_seq_len)
    if job.knobs.output_sigma is not None:
        trace = heavier_tail(trace, p.dataset.dataset, job.knobs.output_sigma, p.seed, p.max_seq_len)
    cfg = sim_config_of(p)
    r = simulate(trace, p.allocator, cfg, step_time_s=step_time_fn(cost_model(p.setting, p.cost_scale)),
                 record_steps=True)
    window = r.overload.window_s
    reading = read_pool(r.steps, r.total_slots, window)
    out = [t.output_len for t in r.requests]  # the measured requests (arrived inside the window)
    inside = [s.time_s for s in r.steps if window[0] <= s.time_s <= window[1]]
    # Little's law: the mean batch = the rate requests leave x the time each spends in the batch, so the
    # batch per (rate x output token) is the mean step time a request's token costs it while running
    return {"row": job.row, "seed": job.seed, **dataclasses.asdict(reading),
            "peak_running": r.peak_running, "num_preemptions": r.num_preemptions,
            "overloaded": r.overload.overloaded, "offered_rate": r.overload.offered_rate,
            "achieved_rate": r.overload.achieved_rate, "mean_output_len": float(np.mean(out)) if out else None,
            "mean_step_ms": 1e3 * (inside[-1] - inside[0]) / max(len(inside) - 1, 1),
            "total_slots": r.total_slots, "num_steps": r.num_steps, "window_s": list(window)}
