"""Swap preemption's exact decisions at their boundaries, driven without a model (sampled tokens are made
up, as in test_scheduler.py): a victim whose distinct blocks fill the host pool exactly is swapped out, not
recomputed; swapped groups come back in the first step whose free blocks are exactly what they need, and
only while the step has budget for them."""

from __future__ import annotations

from pagedbench.refengine import BlockManager
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule
from pagedbench.refengine.kv.host_pool import HostBlockAllocator
from pagedbench.refengine.tests.test_scheduler import make_seq, plan, run_step


def make_swapping(num_blocks: int, host_blocks: int, *, max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                  policy: str = "mixed", block_size: int = 2):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    host = HostBlockAllocator(host_blocks)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      stop=StopRule(frozenset(), 64), prefix_caching=True, policy=policy, preemption_mode="swap",
                      host_allocator=host)
    return bm, host, sched


def pairs(swaps) -> list[tuple[int, int]]:
    return [(s.src, s.dst) for s in swaps]


def test_a_victim_whose_blocks_fill_the_host_pool_exactly_is_swapped_out():
    _, host, sched = make_swapping(6, host_blocks=2)
    for seq_id, n in ((0, 4), (1, 4), (2, 3)):  # 2 + 2 + 2 blocks: the pool is full
        sched.add(make_seq(seq_id, n, max_tokens=6))
    run_step(sched)
    out, _ = run_step(sched)  # seq 0 needs a block for its 5th token: seq 2's two blocks go to the host
    assert out.preempted_seq_ids == (2,) and plan(out) == [(0, 4, 1), (1, 4, 1)]
    assert pairs(out.swap_out) == [(4, 0), (5, 1)] and host.num_free_blocks == 0
    assert sched.num_swap_outs == 1 and sched.num_swap_fallbacks == 0


def test_swapped_groups_come_back_when_the_free_blocks_are_exactly_what_they_need():
    bm, _, sched = make_swapping(5, host_blocks=16, max_num_batched_tokens=6)
    for seq_id, n in ((0, 2), (1, 2), (2, 4)):
        sched.add(make_seq(seq_id, n, max_tokens=5))
    for _ in range(5):  # seq 2 is swapped out in step 1, seq 1 in step 3; seq 0 finishes in step 4
        out, finished = run_step(sched)
    assert [s.seq_id for s in finished] == [0] and bm.num_free_blocks == 5
    # seq 1: two blocks and one for its last token; seq 2: two blocks (its last token is in its table)
    assert [[(s.num_table_tokens, s.num_tokens) for s in g.seqs] for g in sched.swapped] == [[(4, 5)], [(4, 4)]]
    out, _ = run_step(sched)  # 3 + 2 blocks needed, 5 free: both come back in this step
    assert len(out.swap_in) == 4 and not sched.swapped and bm.num_free_blocks == 0
    assert plan(out) == [(1, 4, 1), (2, 2, 2)] and sched.num_swap_ins == 2


def test_swap_ins_stop_when_the_step_s_budget_is_spent():
    """One token a step, prefills before decodes ("separate"): seq 0 decodes alone until it finishes, having
    swapped out seq 2, then seq 1. In the next step seq 1 comes back with the one token; seq 2, whose
    blocks would fit too, waits for a step with budget for it (back without a chunk, it would hold blocks
    while it cannot run)."""
    bm, _, sched = make_swapping(5, host_blocks=16, max_num_batched_tokens=1, policy="separate")
    for seq_id, max_tokens in ((0, 9), (1, 4), (2, 2)):
        sched.add(make_seq(seq_id, 1, max_tokens=max_tokens))
    for _ in range(11):
        run_step(sched)
    assert [[s.seq_id for s in g.seqs] for g in sched.swapped] == [[1], [2]] and bm.num_free_blocks == 5
    out, _ = run_step(sched)
    assert plan(out) == [(1, 1, 1)] and len(out.swap_in) == 1
    assert [[s.seq_id for s in g.seqs] for g in sched.swapped] == [[2]] and [s.seq_id for s in sched.running] == [1]
    out, _ = run_step(sched)
    assert plan(out) == [(2, 1, 1)] and len(out.swap_in) == 1 and not sched.swapped


def test_a_step_with_swap_ins_plans_no_more_tokens_than_its_budget():
    """Parallel-sampling requests (n=3 and n=2) in a 4-block pool: swapped groups come back and each chunk
    of theirs is charged to the step's budget of 4 tokens."""
    _, _, sched = make_swapping(4, host_blocks=16, max_num_batched_tokens=4, max_num_seqs=3, block_size=4)
    for seq_id, (prompt_len, max_tokens, n) in enumerate(((3, 6, 3), (9, 2, 2), (2, 4, 1))):
        sched.add(make_seq(seq_id, prompt_len, max_tokens=max_tokens, n=n))
    num_swap_ins = 0
    for _ in range(40):
        if not sched.has_unfinished():
            break
        out, _ = run_step(sched)
        num_swap_ins += bool(out.swap_in)
        assert sum(c.num_tokens for c in out.chunks) == out.num_batched_tokens <= 4, plan(out)
    assert num_swap_ins > 0 and not sched.has_unfinished()
