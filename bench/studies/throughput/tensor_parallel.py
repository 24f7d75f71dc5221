"""The throughput study's tensor-parallel rows: one batch served with ``tensor_parallel_size`` 1 and 2.

Both sizes serve the same trace from the same model source (a ``ModelConfig``, which every rank loads
itself), with the same number of KV blocks per rank, so the schedule is the same and the greedy tokens
must be too (checked, per request). The sizes alternate within one session, each served
``repetitions`` times on a fresh engine; tokens/s comes from the best wall time. Engines are built
outside the timed region (the spawned ranks' start is not timed).

Besides the wall time, each run measures where rank 0's step time went: its model forward and LM head,
and inside the forward its all-reduces (each timed from the call to its return, which includes waiting
for the other rank to reach the same all-reduce), with their number; and the machine's 1-minute load
average before and after the run, since other processes share its cores.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict

from pagedbench.bench.common.progress import progress_enabled
from pagedbench.bench.common.step_timing import timed_steps
from pagedbench.bench.workloads.token_traces import Trace, Workload, make_trace
from pagedbench.refengine import LLM, SamplingParams
from tqdm import tqdm


@contextmanager
def _threads_for_spawned_ranks(threads: int | None):
    """Spawned ranks read OMP_NUM_THREADS at start; rank 0's own count is set by the study."""
    old = os.environ.get("OMP_NUM_THREADS")
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


@contextmanager
def _timed_all_reduces(llm):
    """[seconds, calls] of rank 0's all-reduces while the block runs (nothing for a single rank)."""
    group = getattr(llm.executor, "group", None)
    totals = [0.0, 0]
    if group is None:
        yield totals
        return
    reduce = group.all_reduce

    def timed(tensor):
        t = time.perf_counter()
        try:
            return reduce(tensor)
        finally:
            totals[0] += time.perf_counter() - t
            totals[1] += 1

    group.all_reduce = timed  # the shard's layers look it up at each call
    try:
        yield totals
    finally:
        del group.all_reduce


def serve(model_cfg, cfg: dict, trace: Trace, size: int) -> dict:
    """One timed generate of ``trace`` with ``tensor_parallel_size=size`` on a fresh engine."""
    with _threads_for_spawned_ranks(cfg["torch_threads"]):
        llm = LLM(model_cfg, dtype=cfg["dtype"], attention_backend=cfg["attention_backend"], seed=cfg["seed"],
                  block_size=cfg["block_size"], num_blocks=cfg["kv_budget_slots"] // cfg["block_size"],
                  max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
                  max_model_len=cfg["max_model_len"], enable_prefix_caching=False, tensor_parallel_size=size)
    try:
        params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in trace.output_lens]
        load_before = os.getloadavg()[0]
        with timed_steps(llm) as times, _timed_all_reduces(llm) as reduces:
            start = time.perf_counter()
            outs = llm.generate([list(p) for p in trace.prompts], params, use_tqdm=progress_enabled())
            wall_s = time.perf_counter() - start
        step_s = sum(times.step_s)
        return {"wall_s": wall_s, "load_avg_1min": [load_before, os.getloadavg()[0]],
                "num_generated_tokens": llm.stats.num_generated_tokens, "num_steps": len(times.step_s),
                "mean_step_ms": times.mean_step_ms, "model_share_of_step": times.model_s / step_s,
                "all_reduce_share_of_step": reduces[0] / step_s, "num_all_reduces": reduces[1],
                "tokens": [o.outputs[0].token_ids for o in outs]}
    finally:
        llm.close()


def study_tensor_parallel(model_cfg, cfg: dict, w: Workload, sizes: list[int], repetitions: int,
                          model: str) -> list[dict]:
    """One record per size: figures of its best repetition, every wall time, and whether its greedy tokens
    equal the first size's request by request."""
    trace = make_trace(w, vocab_size=model_cfg.vocab_size, max_model_len=cfg["max_model_len"], seed=cfg["seed"])
    served: dict[int, list[dict]] = {s: [] for s in sizes}
    for _ in range(repetitions):  # the sizes alternate, so a disturbance hits each alike
        for size in sizes:
            served[size].append(serve(model_cfg, cfg, trace, size))
    base = served[sizes[0]][0]["tokens"]
    records = []
    for size in sizes:
        runs = served[size]
        best = min(runs, key=lambda r: r["wall_s"])
        unequal = sum(t != b for run in runs for t, b in zip(run["tokens"], base))
        figures = {k: v for k, v in best.items() if k != "tokens"}
        figures.update(wall_s_repetitions=[r["wall_s"] for r in runs],
                       generated_tokens_per_s=best["num_generated_tokens"] / best["wall_s"],
                       all_reduces_per_step=best["num_all_reduces"] / best["num_steps"])
        records.append({
            "workload": {**asdict(w), "mean_prompt_len": trace.mean_prompt_len,
                         "mean_output_len": trace.mean_output_len},
            "model": model,
            "implementation": {"allocator": "paged", "tensor_parallel_size": size,
                               "torch_threads_per_rank": cfg["torch_threads"]},
            "status": "ok",
            "validity": {"valid": unequal == 0, "reasons": [] if unequal == 0 else [
                f"{unequal} requests' greedy tokens differ from tensor_parallel_size={sizes[0]}'s"]},
            "figures": figures,
        })
        tqdm.write(f"  {model:8.8s} {w.name:14s} tp={size} {figures['generated_tokens_per_s']:8.1f} tok/s  "
                   f"all-reduce share {figures['all_reduce_share_of_step']:.1%}  same tokens {unequal == 0}")
    return records
