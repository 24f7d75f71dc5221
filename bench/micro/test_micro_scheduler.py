"""Scheduler micro-benchmark: ``schedule()`` + ``update()`` for a running batch of decodes (no model:
every sequence samples token 1), as the engine loop calls them once a step."""

from __future__ import annotations

import pytest
from pagedbench.refengine import BlockManager, SamplingParams
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule
from pagedbench.refengine.engine.sequence import Sequence

pytestmark = pytest.mark.micro

NUM_SEQS, PROMPT_LEN, STEPS, BLOCK_SIZE = 64, 100, 16, 16
PARAMS = SamplingParams(max_tokens=1000, ignore_eos=True)


def step(sched: Scheduler) -> list:
    out = sched.schedule()
    return sched.update(out, {c.seq.seq_id: 1 for c in out.chunks if c.samples})


def decoding() -> Scheduler:
    """A scheduler whose batch has finished prefill: every later step is NUM_SEQS decodes."""
    bm = BlockManager(NUM_SEQS * 24, BLOCK_SIZE, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=NUM_SEQS, max_num_batched_tokens=NUM_SEQS * PROMPT_LEN,
                      stop=StopRule(frozenset(), 4096), prefix_caching=True)
    for i in range(NUM_SEQS):
        prompt = [(i * 31 + t) % 32000 for t in range(PROMPT_LEN)]
        sched.add(Sequence(i, i, 0, prompt, PROMPT_LEN, PARAMS, None))
    step(sched)
    return sched


def decode_steps(sched: Scheduler) -> Scheduler:
    for _ in range(STEPS):
        step(sched)
    return sched


def test_micro_scheduler_step(run_micro):
    sched = decode_steps(decoding())
    assert len(sched.running) == NUM_SEQS
    assert all(len(s.token_ids) == PROMPT_LEN + 1 + STEPS for s in sched.running)
    run_micro(decode_steps, lambda: (decoding(),))
