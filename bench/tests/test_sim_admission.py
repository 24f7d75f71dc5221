"""The fast-forward's admission (:func:`pagedbench.bench.sim.admission.admit`) is the scheduler's own
``_admit``: the same chunks, budget, queue, running sequences, blocks and statistics (the refused
allocation counted), with that allocation not made."""

from __future__ import annotations

import random

import pytest
from pagedbench.bench.sim.admission import admit, first_refused
from pagedbench.refengine import BlockManager, SamplingParams
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule
from pagedbench.refengine.engine.sequence import Sequence


class _Counting(BlockManager):
    """Counts its allocate calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def allocate(self, *args, **kwargs):
        self.calls += 1
        return super().allocate(*args, **kwargs)


def _seq(seq_id: int, rid: int, n: int, children: int = 0) -> Sequence:
    params = SamplingParams(max_tokens=8, ignore_eos=True, n=1 + children)
    s = Sequence(seq_id, rid, 0, [seq_id % 5] * n, n, params, None)
    s.pending_children = [Sequence(1000 + seq_id * 10 + i, rid, i + 1, [0] * n, n, params, None)
                          for i in range(children)]
    return s


def _scene(seed: int, prefix: bool = False) -> tuple[Scheduler, _Counting]:
    """A scheduler with running sequences holding blocks and a queue (sometimes a group of one request's
    sequences, or one with children to fork), drawn from ``seed``."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 16])
    bm = _Counting(rng.randrange(6, 30), bs, enable_prefix_caching=prefix)
    sched = Scheduler(bm, max_num_seqs=rng.randrange(2, 12), max_num_batched_tokens=rng.randrange(4, 400),
                      stop=StopRule(frozenset(), 10_000), prefix_caching=prefix,
                      watermark_blocks=rng.choice([0, 0, 1, 3]))
    sid = 0
    for _ in range(rng.randrange(0, 4)):  # running ones (some with children to fork after their prefill)
        sched.add(_seq(sid, sid, rng.randrange(1, 3 * bs), children=int(rng.random() < 0.3)))
        sid += 1
    sched._admit([], [], 10_000)
    for _ in range(rng.randrange(1, 9)):  # the queue
        rid, n = sid, rng.randrange(1, 6 * bs)
        twins = 1 + (rng.random() < 0.1)  # a group preempted together: one request, two sequences
        for t in range(twins):
            sched.add(_seq(sid, rid, n, children=int(rng.random() < 0.05)) if t == 0 else
                      Sequence(sid, rid, t, [0] * n, n, SamplingParams(max_tokens=8, n=2), None))
            sid += 1
    return sched, bm


def _outcome(sched: Scheduler, bm: BlockManager, chunks: list, budget: int) -> tuple:
    bm.check_invariants()
    return (budget, [(c.seq.seq_id, c.start, c.num_tokens) for c in chunks],
            [s.seq_id for s in sched.waiting], [(s.seq_id, s.status, s.num_computed_tokens) for s in sched.running],
            [bm.block_table(s.seq_id) for s in sched.running], bm.free_block_ids(), bm.metrics())


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "prefix-cache"])
def test_admit_is_the_schedulers_admission(prefix):
    spared = 0
    for seed in range(300):
        (plain, plain_bm), (fast, fast_bm) = _scene(seed, prefix), _scene(seed, prefix)
        budget = random.Random(seed).choice([1, 7, 30, plain.max_num_batched_tokens, 10_000, 10_000])
        plain_chunks, fast_chunks = [], []
        plain_left = plain._admit(plain_chunks, [], budget)
        fast_left = admit(fast, fast_chunks, budget)
        assert _outcome(fast, fast_bm, fast_chunks, fast_left) == _outcome(plain, plain_bm, plain_chunks, plain_left)
        assert fast_bm.calls <= plain_bm.calls
        spared += plain_bm.calls - fast_bm.calls
    if prefix:
        assert spared == 0  # hits change what a prompt takes: the scheduler's own admission
    else:
        assert spared > 30  # the refused allocations were not made


def test_first_refused_counts_blocks_the_watermark_and_the_budget():
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, stop=StopRule(frozenset(), 100),
                      prefix_caching=False, watermark_blocks=1)
    for i, n in enumerate([8, 16, 16, 3]):  # 2 + 4 blocks fit in the 9 the watermark leaves; 4 more do not
        sched.add(_seq(i, i, n))
    assert first_refused(sched, 100) == 2
    assert first_refused(sched, 24) is None  # the budget is spent by the second: the loop stops there
    assert first_refused(sched, 25) == 2
    sched.waiting[1].pending_children = [_seq(50, 1, 16)]
    assert first_refused(sched, 100) is None  # a request with children to fork: the scheduler's own way
