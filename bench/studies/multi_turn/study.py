"""Multi-turn serving: how much of each round's prompt the prefix cache still holds, and what it costs when
it does not.

``python -m pagedbench.bench multi_turn [--full]``. Writes ``results/multi_turn.{json,md}``.

The workload is SGLang's multi-turn benchmark shape (:data:`pagedbench.bench.workloads.sessions.
SGLANG_MULTITURN`: clients x rounds, a 512-token message and a 64-token answer a round), sessions starting
Poisson at ``session_rate``, each next round released ``think_s`` after the previous answer completes
(:mod:`pagedbench.bench.sim.follow_ups`). Each round's prompt repeats the session's history, so with room
a prefix cache serves all of it but the new message. The simulator runs the real scheduler with the
paged manager's prefix cache on one device (the cost model of ``model`` on ``hardware``) at KV budgets
given as shares of every session's final history together: one that holds them all and one that holds a
fraction, where cached histories are evicted before their next round comes and the hit rate collapses.

Per round, of the prompt tokens at each request's first admission: the share found on the device
(``device_hit_rate``), the share loaded from the host tier (``host_hit_rate``), the share computed
(``computed_share``; the three add up to 1, ``hit_rate`` is the first two together), and TTFT (mean, p90).

**Tiers.** Each budget is served by every entry of ``tiers`` (:data:`TIERS`): ``device``, the device
pool's prefix cache alone, and ``host``, the same pool with the prefix cache's host tier of the engine's
``LLM(kv_offloading_size=GiB)`` (``SimConfig(offload_blocks=N)``) sized to :data:`HOST_TIER_SHARE` times
every session's final history, so that no history the device evicts is lost. Its copies are priced over
the GPU's host link (:class:`pagedbench.bench.costmodel.host_link.BlockCopyCost`, our engine's
``per_layer`` layout: one gathered copy per layer for K and for V a step) and added to the step that makes
them. SGLang's HiCache blog and Mooncake's HiCache benchmark page are the published references for
the difference (the report cites what they say).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pagedbench.bench.common.quick_full import run_quick_or_full
from pagedbench.bench.common.serving_metrics import request_metrics
from pagedbench.bench.costmodel import StepCostModel, load_hardware, load_model
from pagedbench.bench.costmodel.host_link import BlockCopyCost
from pagedbench.bench.sim.points import step_time_fn
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.bench.workloads import sessions

#: the host tier's size in shares of every session's final history (as the device budget that holds them all)
HOST_TIER_SHARE = 1.25


def _device_tier(cfg: MultiTurnConfig, kv_slots: int, history_tokens: int) -> dict:
    """The device pool's prefix cache alone."""
    return {"cfg": SimConfig(kv_slots=kv_slots, max_seq_len=cfg.max_seq_len, enable_prefix_caching=True,
                             max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                             warmup_frac=0.0)}


def host_tier_blocks(cfg: MultiTurnConfig, history_tokens: int) -> int:
    """The host tier's blocks: :data:`HOST_TIER_SHARE` x every session's final history."""
    return -(-int(HOST_TIER_SHARE * history_tokens) // cfg.block_size)


def _host_tier(cfg: MultiTurnConfig, kv_slots: int, history_tokens: int) -> dict:
    """The same device pool with the prefix cache's host tier (``kv_offloading_size``) behind it."""
    device = _device_tier(cfg, kv_slots, history_tokens)["cfg"]
    return {"cfg": dataclasses.replace(device, offload_blocks=host_tier_blocks(cfg, history_tokens))}


#: how each tier is simulated: name -> (config, budget in slots, every session's final history in tokens)
#: -> simulate()'s keyword arguments
TIERS: dict[str, Callable[[MultiTurnConfig, int, int], dict]] = {"device": _device_tier, "host": _host_tier}


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    model: str = "llama-3.1-8b"
    hardware: str = "h100-sxm"
    linear_model: str = "tile"  # the serving study's pricing of the linear layers (bench/sim/settings.py)
    max_seq_len: int = 8192
    num_clients: int = 256
    num_rounds: int = 5
    user_len: tuple[int, int] = (512, 512)
    answer_len: tuple[int, int] = (64, 64)
    think_s: float = 1.0
    session_rate: float = 8.0  # sessions starting per second (Poisson)
    # KV budgets as shares of every session's final history together (1.25: all of them fit)
    budget_shares: tuple[float, ...] = (1.25, 0.25)
    tiers: tuple[str, ...] = ("device", "host")
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    seeds: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in TIERS]
        if unknown:
            raise ValueError(f"unknown tiers {unknown}; known: {sorted(TIERS)}")
        if not self.budget_shares or any(not s > 0 for s in self.budget_shares):
            raise ValueError(f"budget_shares must be > 0, got {self.budget_shares}")


QUICK = MultiTurnConfig(num_clients=128, budget_shares=(1.25, 0.5, 0.25), seeds=(0, 1))
FULL = MultiTurnConfig(seeds=(0, 1, 2), budget_shares=(1.25, 0.75, 0.5, 0.25, 0.1))


def _shape(cfg: MultiTurnConfig) -> sessions.MultiTurnShape:
    return sessions.MultiTurnShape(cfg.num_clients, cfg.num_rounds, cfg.user_len, cfg.answer_len, cfg.think_s)


def history_tokens(trace: sessions.SessionTrace) -> int:
    """Every session's final history (its last prompt and answer) together, in tokens."""
    last: dict[int, int] = {}
    for r in trace.requests:
        s, _ = trace.turn[r.request_id]
        last[s] = r.prompt_len + r.output_len
    return sum(last.values())


def per_round(trace: sessions.SessionTrace, result) -> list[dict]:
    """Each round's prompt tokens at first admission split by where they came from (device hits, host-tier
    loads, computed), and its TTFT."""
    cached, host = dict(result.cached_tokens), dict(result.host_cached_tokens)
    rows = []
    for k in range(max(rnd for _, rnd in trace.turn.values()) + 1):
        ids = [rid for rid, (_, rnd) in trace.turn.items() if rnd == k]
        prompt = sum(len(trace.token_ids[i]) for i in ids)
        hits = sum(cached.get(i, 0) for i in ids)
        host_hits = sum(host.get(i, 0) for i in ids)
        timings = [t for t in result.requests if trace.turn[t.request_id][1] == k and t.finished]
        ttft = [request_metrics(t).ttft_s for t in timings]
        rows.append({"round": k, "num_requests": len(ids), "prompt_tokens": prompt,
                     "hit_tokens": hits, "host_hit_tokens": host_hits, "hit_rate": hits / prompt,
                     "device_hit_rate": (hits - host_hits) / prompt, "host_hit_rate": host_hits / prompt,
                     "computed_share": (prompt - hits) / prompt,
                     "mean_ttft_s": float(np.mean(ttft)) if ttft else None,
                     "p90_ttft_s": float(np.percentile(ttft, 90)) if ttft else None})
    return rows


def run_one(cfg: MultiTurnConfig, tier: str, share: float, seed: int) -> dict:
    trace = sessions.multi_turn(_shape(cfg), rate=cfg.session_rate, seed=seed)
    history = history_tokens(trace)
    slots = -(-int(share * history) // cfg.block_size) * cfg.block_size
    model, hardware = load_model(cfg.model), load_hardware(cfg.hardware)
    step = step_time_fn(StepCostModel.from_profiles(model, hardware, linear=cfg.linear_model))
    # a host tier's stores and loads over the GPU's host link, in our engine's gathered per-layer copies
    step.block_copy_s = BlockCopyCost.of(model, hardware, cfg.block_size, layout="per_layer")
    kwargs = TIERS[tier](cfg, slots, history)
    start = time.perf_counter()
    r = simulate(trace.requests, AllocatorSpec("paged", cfg.block_size), step_time_s=step, account=False,
                 prompt_tokens=trace.prompt_tokens, **kwargs)
    return {"tier": tier, "budget_share": share, "seed": seed, "kv_slots": slots, "history_tokens": history,
            "host_blocks": kwargs["cfg"].num_offload_blocks, "num_preemptions": r.num_preemptions,
            "simulated_s": r.simulated_s, "wall_s": time.perf_counter() - start,
            "prefix_hit_tokens": r.prefix_hit_tokens, "prefix_host_hit_tokens": r.prefix_host_hit_tokens,
            "prefix_computed_tokens": r.prefix_computed_tokens,
            "num_offload_stored_blocks": r.num_offload_stored_blocks,
            "num_offload_loaded_blocks": r.num_offload_loaded_blocks, "copy_s": r.copy_s,
            "rounds": per_round(trace, r)}


def run_study(cfg: MultiTurnConfig, *, progress: bool = True) -> dict:
    runs = []
    for tier in cfg.tiers:
        for share in cfg.budget_shares:
            for seed in cfg.seeds:
                runs.append(run_one(cfg, tier, share, seed))
                if progress:
                    hits = " ".join(f"{x['hit_rate']:.2f}" for x in runs[-1]["rounds"])
                    print(f"  {tier} budget {share:g} x histories seed {seed}: hit rate (both tiers) by round {hits}",
                          flush=True)
    return {"config": dataclasses.asdict(cfg), "host_tier_share": HOST_TIER_SHARE, "runs": runs}


def main(argv: list[str]) -> None:
    from pagedbench.bench.studies.multi_turn import report

    run_quick_or_full(argv, prog="python -m pagedbench.bench multi_turn", description=__doc__,
                      full_help="256 clients, 3 seeds, five budgets", quick=QUICK, full=FULL, run=run_study,
                      markdown=report.markdown, name="multi_turn")
