"""Figure 16 of the vLLM paper: translation requests behind a shared few-shot prefix.

``python -m pagedbench.bench shared_prefix [--full]``. Writes ``results/shared_prefix.{json,md}``.

The paper serves LLaMA-13B translating WMT16 English to German, every prompt one shared prefix (a
one-shot example of 80 tokens, or five of 341) and the sentence to translate, and reports vLLM's
throughput at Orca (Oracle)'s latency: 1.67x (one-shot) and 3.58x (five-shot). Here: the workloads
``fewshot-1`` and ``fewshot-5`` (:mod:`pagedbench.bench.workloads.sessions`: the prefix's token ids are
the same in every request, so the paged manager's prefix cache keys hit them), on the LLaMA-13B shape
(``llama-2-13b``'s profile, the same layers and widths; the context cut to LLaMA-1's 2048) on an A100-40GB,
the paper's scheduler policy (``separate``). The contenders: Orca (Oracle) (a reservation of exactly
prompt + output: it cannot share), paged without a prefix cache, and paged with it. Capacity is the
serving study's: the highest Poisson rate whose normalized latency stays within ``threshold`` x the
low-load value (:mod:`pagedbench.bench.sim.paired_capacity`); ratios are paired by seed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedbench.bench.common.quick_full import run_quick_or_full
from pagedbench.bench.costmodel import kv_slot_budget, load_hardware, load_model
from pagedbench.bench.sim.paired_capacity import Contender, capacities, paired_ratio
from pagedbench.bench.sim.points import Method
from pagedbench.bench.sim.settings import Dataset, Setting
from pagedbench.bench.sim.simulator import AllocatorSpec

#: the paper's Fig. 16: vLLM's throughput over Orca (Oracle)'s, by prefix
PAPER_RATIO = {"fewshot-1": 1.67, "fewshot-5": 3.58}
ORCA, PAGED, CACHED = "Orca (Oracle)", "paged", "paged + prefix cache"
CONTENDERS = (Contender(CACHED, AllocatorSpec("paged", 16), True), Contender(PAGED, AllocatorSpec("paged", 16)),
              Contender(ORCA, AllocatorSpec("orca", 1, "oracle")))


@dataclass(frozen=True, slots=True)
class SharedPrefixConfig:
    model: str = "llama-2-13b"  # LLaMA-13B's shape
    hardware: str = "a100-40gb"
    max_seq_len: int = 2048
    workloads: tuple[str, ...] = ("fewshot-1", "fewshot-5")
    linear_model: str = "tile"  # the serving study's pricing of the linear layers (bench/sim/settings.py)
    policy: str = "separate"
    threshold: float = 2.0
    seeds: tuple[int, ...] = (0, 1, 2)
    span_s: float = 60.0
    low_load_requests: int = 60
    warmup_frac: float = 0.1
    cooldown_frac: float = 0.1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    bisection_steps: int = 5
    workers: int = 2


QUICK = SharedPrefixConfig(seeds=(0, 1), span_s=30.0, bisection_steps=4)
FULL = SharedPrefixConfig(seeds=(0, 1, 2, 3, 4), span_s=300.0, bisection_steps=6)


def run_study(cfg: SharedPrefixConfig, *, progress: bool = True) -> dict:
    setting = Setting(f"{cfg.model}@{cfg.hardware}", cfg.model, cfg.hardware, cfg.max_seq_len,
                      linear_model=cfg.linear_model)
    slots = kv_slot_budget(load_model(cfg.model), load_hardware(cfg.hardware)).num_slots
    method = Method(cfg.span_s, cfg.low_load_requests, cfg.warmup_frac, cfg.cooldown_frac, 3.0, cfg.max_num_seqs,
                    cfg.max_num_batched_tokens, 0.01, ())
    datasets = [Dataset(w, workload=w) for w in cfg.workloads]
    searches = capacities(setting, datasets, list(CONTENDERS), seeds=cfg.seeds, method=method,
                          max_seq_len=cfg.max_seq_len, kv_slots=slots, threshold=cfg.threshold,
                          steps=cfg.bisection_steps, policy=cfg.policy, workers=cfg.workers,
                          progress=(lambda s: print(s, flush=True)) if progress else None)
    crit = str(cfg.threshold)
    ratios = [{"dataset": w, "ours": ours, "versus": ORCA, "ratio": paired_ratio(searches, w, ours, ORCA, crit),
               "paper": PAPER_RATIO.get(w) if ours == CACHED else None}
              for w in cfg.workloads for ours in (CACHED, PAGED)]
    ratios += [{"dataset": w, "ours": CACHED, "versus": PAGED, "ratio": paired_ratio(searches, w, CACHED, PAGED, crit),
                "paper": None} for w in cfg.workloads]
    return {"config": dataclasses.asdict(cfg), "kv_slots": slots, "criterion": crit, "searches": searches,
            "ratios": ratios}


def main(argv: list[str]) -> None:
    from pagedbench.bench.studies.shared_prefix import report

    run_quick_or_full(argv, prog="python -m pagedbench.bench shared_prefix", description=__doc__,
                      full_help="5 seeds, 5-minute spans, finer bisection", quick=QUICK, full=FULL, run=run_study,
                      markdown=report.markdown, name="shared_prefix")
