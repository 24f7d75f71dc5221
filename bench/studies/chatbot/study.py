"""Figure 17 of the vLLM paper: a chatbot, each prompt the conversation so far cut to its last 1024 tokens.

``python -m pagedbench.bench chatbot [--full]``. Writes ``results/chatbot.{json,md}``.

The paper serves OPT-13B as a chatbot: each round's prompt is the chatting history and the new query
(synthesized from ShareGPT), cut to the last 1024 tokens, the answer at most 1024 tokens; it keeps no KV
between rounds (that would hold memory other requests need), so rounds arrive as independent Poisson
requests; vLLM sustains 2x the rate of every Orca variant. Here: the workload ``chatbot-1024``
(:func:`pagedbench.bench.workloads.sessions.chatbot`: ShareGPT-like messages and answers, four rounds a
session, the history cut to 1024 tokens), OPT-13B on an A100-40GB, the paper's ``separate`` policy, paged
(block size 16) against Orca Max, Pow2 and Oracle, prefix caching off as in the paper. Capacity as in the
serving study (:mod:`pagedbench.bench.sim.paired_capacity`), ratios paired by seed.
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

#: the paper's Fig. 17: vLLM's rate over each Orca variant's ("2x higher request rates than the three Orca
#: baselines")
PAPER_RATIO = 2.0
PAGED = "paged"
CONTENDERS = (Contender(PAGED, AllocatorSpec("paged", 16)), Contender("Orca (Max)", AllocatorSpec("orca", 1, "max")),
              Contender("Orca (Pow2)", AllocatorSpec("orca", 1, "pow2")),
              Contender("Orca (Oracle)", AllocatorSpec("orca", 1, "oracle")))


@dataclass(frozen=True, slots=True)
class ChatbotConfig:
    model: str = "opt-13b"
    hardware: str = "a100-40gb"
    max_seq_len: int = 2048
    workload: str = "chatbot-1024"
    linear_model: str = "tile"  # the serving study's pricing of the linear layers (bench/sim/settings.py)
    policy: str = "separate"
    threshold: float = 2.0
    seeds: tuple[int, ...] = (0, 1, 2)
    span_s: float = 300.0
    low_load_requests: int = 40
    warmup_frac: float = 0.1
    cooldown_frac: float = 0.1
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    bisection_steps: int = 5
    workers: int = 2


QUICK = ChatbotConfig(seeds=(0, 1, 2), span_s=120.0, bisection_steps=4)
FULL = ChatbotConfig(seeds=(0, 1, 2, 3, 4), span_s=900.0, bisection_steps=6)


def run_study(cfg: ChatbotConfig, *, progress: bool = True) -> dict:
    setting = Setting(f"{cfg.model}@{cfg.hardware}", cfg.model, cfg.hardware, cfg.max_seq_len,
                      linear_model=cfg.linear_model)
    slots = kv_slot_budget(load_model(cfg.model), load_hardware(cfg.hardware)).num_slots
    method = Method(cfg.span_s, cfg.low_load_requests, cfg.warmup_frac, cfg.cooldown_frac, 3.0, cfg.max_num_seqs,
                    cfg.max_num_batched_tokens, 0.01, ())
    searches = capacities(setting, [Dataset(cfg.workload, workload=cfg.workload)], list(CONTENDERS), seeds=cfg.seeds,
                          method=method, max_seq_len=cfg.max_seq_len, kv_slots=slots, threshold=cfg.threshold,
                          steps=cfg.bisection_steps, policy=cfg.policy, workers=cfg.workers,
                          progress=(lambda s: print(s, flush=True)) if progress else None)
    crit = str(cfg.threshold)
    ratios = [{"dataset": cfg.workload, "ours": PAGED, "versus": c.label, "paper": PAPER_RATIO,
               "ratio": paired_ratio(searches, cfg.workload, PAGED, c.label, crit)} for c in CONTENDERS[1:]]
    return {"config": dataclasses.asdict(cfg), "kv_slots": slots, "criterion": crit, "searches": searches,
            "ratios": ratios}


def main(argv: list[str]) -> None:
    from pagedbench.bench.studies.chatbot import report

    run_quick_or_full(argv, prog="python -m pagedbench.bench chatbot", description=__doc__,
                      full_help="5 seeds, 15-minute spans, finer bisection", quick=QUICK, full=FULL, run=run_study,
                      markdown=report.markdown, name="chatbot")
