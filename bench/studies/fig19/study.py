"""Figure 19 of the vLLM paper: swap or recompute a preempted sequence's KV, by block size.

``python -m pagedbench.bench fig19 [--full]``. Writes ``results/fig19_swap.{json,md}``.

**(a) Per block.** For block sizes 1..256:

- *the cost model* (OPT-13B on an A100-40GB, the paper's setting): one block's copy over the host link
  (:mod:`pagedbench.bench.costmodel.host_link`: ``2 x layers`` transfers of the block's share, vLLM v0's
  per-block ``cudaMemcpyAsync``), against the recompute of its tokens (a ``T``-token prefill step from the
  step-cost model, times ``block_size / T``); and for a whole preempted sequence of ``T`` tokens, swapping
  it out and in (``2 ceil(T / bs)`` block copies) against recomputing it (flat in block size: recompute
  uses no block);
- *measured on the CPU engine* (the random ``small`` model of ``bench/configs/models.yaml``; no SmolLM2
  checkpoint is needed): the engine's batched copy
  (:func:`~pagedbench.refengine.kv.swap_copy.copy_blocks_between`) of a ``T``-token sequence's blocks
  between a device pool and a host pool, per block, against the engine's prefill of ``T`` tokens
  (``LLM.generate``, one output token) per block. On the CPU both pools are host memory, so this
  measures the engine's copy path, not PCIe.

**(b) End to end.** The simulator (the real scheduler) serves ShareGPT-like requests, Poisson at a few
rates, with ``preemption_mode`` recompute and swap (host pool: vLLM's default 4 GiB), the paper's
scheduler policy (``separate``), at each block size; a swapping step lasts as much longer as its copies
cost. Reported: mean normalized latency (s per output token) over seeds with its 95% interval, the ratio
recompute / swap paired by seed (both modes serve the same arrivals, so the trace-to-trace noise cancels:
the geometric mean of the per-seed ratios with the Student-t interval of their logs), preemptions,
blocks swapped and the copy time.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass

from pagedbench.bench import workloads
from pagedbench.bench.common.model_files import MODELS_YAML
from pagedbench.bench.common.quick_full import run_quick_or_full
from pagedbench.bench.costmodel import StepCostModel, kv_slot_budget, load_hardware, load_model
from pagedbench.bench.costmodel.host_link import BlockCopyCost
from pagedbench.bench.sim.capacity_search import estimate, log_estimate
from pagedbench.bench.sim.points import step_time_fn
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Fig19Config:
    model: str = "opt-13b"
    hardware: str = "a100-40gb"
    linear_model: str = "tile"  # the serving study's pricing of the linear layers (bench/sim/settings.py)
    block_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    sequence_tokens: int = 1024  # T: the preempted sequence whose KV is swapped or recomputed
    # (b)
    sim_block_sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    rates: tuple[float, ...] = (2.0, 2.5, 3.0)
    span_s: float = 300.0
    seeds: tuple[int, ...] = (0, 1, 2)
    swap_space_gib: float = 4.0  # vLLM's default swap_space
    policy: str = "separate"
    max_num_batched_tokens: int = 2048
    # CPU engine measurement
    cpu_model: str = "small"
    cpu_block_sizes: tuple[int, ...] = (1, 4, 16, 64, 256)
    cpu_sequence_tokens: int = 512
    cpu_repeats: int = 5


QUICK = Fig19Config(span_s=120.0, sim_block_sizes=(8, 16, 64, 256), cpu_block_sizes=(1, 16, 256), cpu_repeats=3)
FULL = Fig19Config(seeds=(0, 1, 2, 3, 4), span_s=600.0, rates=(1.5, 2.0, 2.5, 3.0))


def _recompute_s(cost: StepCostModel, num_tokens: int) -> float:
    """One prefill step of ``num_tokens`` tokens from nothing (the step's fixed cost included)."""
    return cost.time_from_totals_s(num_tokens, 1, 0, ((num_tokens, 0),))


def cost_model_rows(cfg: Fig19Config) -> list[dict]:
    model, hw = load_model(cfg.model), load_hardware(cfg.hardware)
    cost = StepCostModel.from_profiles(model, hw, linear=cfg.linear_model)
    t = cfg.sequence_tokens
    recompute = _recompute_s(cost, t)
    rows = []
    for bs in cfg.block_sizes:
        copy = BlockCopyCost.of(model, hw, bs)
        blocks = -(-t // bs)
        rows.append({"block_size": bs, "bytes_per_block": copy.bytes_per_block, "swap_block_s": copy.block_s,
                     "recompute_block_s": recompute * bs / t,
                     "sequence_swap_out_in_s": 2 * copy.step_s(blocks), "sequence_recompute_s": recompute,
                     "sequence_swap_batched_s": 2 * dataclasses.replace(copy, layout="per_layer").step_s(blocks)})
    return rows


def cpu_engine_rows(cfg: Fig19Config) -> list[dict]:
    """The engine's copy path and prefill, timed on this machine (module docstring)."""
    import torch
    from pagedbench.refengine import LLM, BlockPool, ModelConfig, SamplingParams
    from pagedbench.refengine.kv.host_pool import HostBlockPool
    from pagedbench.refengine.kv.swap_copy import copy_blocks_between

    mc = ModelConfig.from_yaml(MODELS_YAML, cfg.cpu_model)
    t = cfg.cpu_sequence_tokens
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, mc.vocab_size, (t,), generator=gen).tolist()
    llm = LLM(mc, block_size=16, num_blocks=2 * t // 16 + 8, max_num_batched_tokens=t, max_model_len=t + 8,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    prefill = []
    for _ in range(cfg.cpu_repeats):
        start = time.perf_counter()
        llm.generate([prompt], params)
        prefill.append(time.perf_counter() - start)
    recompute = statistics.median(prefill)
    head_dim = mc.hidden_size // mc.num_attention_heads
    rows = []
    for bs in cfg.cpu_block_sizes:
        blocks = -(-t // bs)
        pool = BlockPool(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, bs, num_blocks=blocks, poison=False)
        host = HostBlockPool(pool, blocks)
        pairs = [(i, i) for i in range(blocks)]
        copy_blocks_between(pool.kv_caches(), host.kv_caches(), pairs)  # warm-up
        times = []
        for _ in range(cfg.cpu_repeats):
            start = time.perf_counter()
            copy_blocks_between(pool.kv_caches(), host.kv_caches(), pairs)
            copy_blocks_between(host.kv_caches(), pool.kv_caches(), pairs)
            times.append(time.perf_counter() - start)
        swap = statistics.median(times)
        rows.append({"block_size": bs, "bytes_per_block": host.bytes_per_block, "num_blocks": blocks,
                     "swap_out_in_block_s": swap / blocks, "recompute_block_s": recompute * bs / t,
                     "sequence_swap_out_in_s": swap, "sequence_recompute_s": recompute})
    return rows


def _sim_point(cfg: Fig19Config, bs: int, rate: float, seed: int, mode: str) -> dict:
    model, hw = load_model(cfg.model), load_hardware(cfg.hardware)
    slots = kv_slot_budget(model, hw).num_slots
    step = step_time_fn(StepCostModel.from_profiles(model, hw, linear=cfg.linear_model))
    copy = BlockCopyCost.of(model, hw, bs)
    step.block_copy_s = copy
    trace = workloads.synthetic("sharegpt", max(2, math.ceil(rate * cfg.span_s)), rate=rate, seed=seed)
    swap_blocks = int(cfg.swap_space_gib * GIB) // copy.bytes_per_block
    sim_cfg = SimConfig(kv_slots=slots, preemption_mode=mode, swap_blocks=swap_blocks, policy=cfg.policy,
                        max_num_batched_tokens=cfg.max_num_batched_tokens)
    start = time.perf_counter()
    r = simulate(trace, AllocatorSpec("paged", bs), sim_cfg, step_time_s=step, account=False)
    return {"block_size": bs, "rate": rate, "seed": seed, "mode": mode, "num_requests": len(trace),
            "normalized_latency_s": r.mean_normalized_latency_s, "num_preemptions": r.num_preemptions,
            "num_swapped_out_blocks": r.num_swapped_out_blocks, "copy_s": r.copy_s, "simulated_s": r.simulated_s,
            "num_finished": r.num_finished, "wall_s": time.perf_counter() - start}


def sim_rows(cfg: Fig19Config, progress: bool = True) -> list[dict]:
    rows = []
    for bs in cfg.sim_block_sizes:
        for rate in cfg.rates:
            for seed in cfg.seeds:
                for mode in ("recompute", "swap"):
                    rows.append(_sim_point(cfg, bs, rate, seed, mode))
            if progress:
                got = {r["mode"]: r["normalized_latency_s"] for r in rows[-2:]}
                print(f"  bs={bs} rate={rate} (seed {seed}): recompute {got['recompute']:.4f}, swap "
                      f"{got['swap']:.4f} s/token", flush=True)
    return rows


def _interval(e) -> dict:
    return {"mean": e.mean, "low": e.low, "high": e.high, "num_seeds": e.num_seeds}


def paired_rows(points: list[dict]) -> list[dict]:
    """Per (block size, rate): each mode's normalized latency over seeds (mean, 95% interval) and the
    ratio recompute / swap paired by seed (None where no seed has both latencies)."""
    by: dict[tuple[int, float], dict[str, dict[int, float]]] = {}
    for p in points:
        if p["normalized_latency_s"] is not None:
            by.setdefault((p["block_size"], p["rate"]), {}).setdefault(p["mode"], {})[p["seed"]] = \
                p["normalized_latency_s"]
    rows = []
    for (bs, rate), modes in sorted(by.items()):
        rec, swap = modes.get("recompute", {}), modes.get("swap", {})
        seeds = sorted(set(rec) & set(swap))
        rows.append({"block_size": bs, "rate": rate,
                     "recompute_s": _interval(estimate(list(rec.values()))) if rec else None,
                     "swap_s": _interval(estimate(list(swap.values()))) if swap else None,
                     "recompute_over_swap": _interval(log_estimate([rec[k] / swap[k] for k in seeds]))
                     if seeds else None})
    return rows


def run_study(cfg: Fig19Config, *, progress: bool = True) -> dict:
    slots = kv_slot_budget(load_model(cfg.model), load_hardware(cfg.hardware)).num_slots
    doc = {"config": dataclasses.asdict(cfg), "kv_slots": slots, "cost_model": cost_model_rows(cfg),
           "cpu_engine": cpu_engine_rows(cfg), "simulated": sim_rows(cfg, progress)}
    doc["paired"] = paired_rows(doc["simulated"])
    return doc


def main(argv: list[str]) -> None:
    from pagedbench.bench.studies.fig19 import report

    run_quick_or_full(argv, prog="python -m pagedbench.bench fig19", description=__doc__,
                      full_help="5 seeds, 10-minute spans, more rates and block sizes", quick=QUICK, full=FULL,
                      run=run_study, markdown=report.markdown, name="fig19_swap")
