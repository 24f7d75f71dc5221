"""The scheduler's exact decisions, driven without a model (sampled tokens are made up): FCFS admission,
chunked prefill under the token budget with decodes first, the newest sequence preempted and re-queued
ahead of new requests, blocks freed the step a request finishes, seats for the children a
parallel-sampling request will fork, and copy-on-write copies reported when forked children append."""

from __future__ import annotations

import pytest
from pagedbench.refengine import BlockManager, SamplingParams
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule
from pagedbench.refengine.engine.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks: int, block_size: int, *, max_num_seqs=8, max_num_batched_tokens=64):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    return bm, Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         stop=StopRule(frozenset(), 64), prefix_caching=True)


def make_seq(seq_id: int, prompt_len: int, *, max_tokens: int = 4, n: int = 1, request_id=None):
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    rid = seq_id if request_id is None else request_id
    prompt = [(seq_id * 7 + i) % 100 for i in range(prompt_len)]  # distinct per sequence: no prefix hits
    return Sequence(seq_id, rid, 0, prompt, prompt_len, params, None)


def run_step(sched, token: int = 1):
    out = sched.schedule()
    sampled = {}
    for c in out.chunks:
        if c.samples:
            for s in (c.seq, *c.seq.pending_children):
                sampled[s.seq_id] = token
    return out, sched.update(out, sampled)


def plan(out) -> list[tuple[int, int, int]]:
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks]


def test_scheduler_fcfs_chunked_decodes_first():
    _, sched = make_scheduler(32, 4, max_num_batched_tokens=6)
    for seq_id, n in ((0, 4), (1, 7), (2, 2)):
        sched.add(make_seq(seq_id, n))
    out, _ = run_step(sched)
    assert plan(out) == [(0, 0, 4), (1, 0, 2)]  # seq 1 chunked to the 2 tokens left; seq 2 waits
    assert [s.seq_id for s in sched.waiting] == [2]
    out, _ = run_step(sched)
    assert plan(out) == [(0, 4, 1), (1, 2, 5)]  # the decode first, then the rest of seq 1's prompt
    out, _ = run_step(sched)
    assert plan(out) == [(0, 5, 1), (1, 7, 1), (2, 0, 2)]  # two decodes, then seq 2 admitted
    assert out.num_batched_tokens == 4


def test_scheduler_preempts_newest_and_requeues_it_first():
    bm, sched = make_scheduler(6, 2)
    for seq_id, n in ((0, 4), (1, 4), (2, 3)):  # 2 + 2 + 2 blocks: the pool is full
        sched.add(make_seq(seq_id, n))
    out, _ = run_step(sched)
    assert plan(out) == [(0, 0, 4), (1, 0, 4), (2, 0, 3)] and bm.num_free_blocks == 0
    sched.add(make_seq(3, 2))  # a new request arrives behind them
    out, _ = run_step(sched)
    # seq 0 needs a block for its 5th token: seq 2 (the newest) is preempted; seq 1 takes seq 2's other block
    assert out.preempted_seq_ids == (2,) and plan(out) == [(0, 4, 1), (1, 4, 1)]
    assert [s.seq_id for s in sched.waiting] == [2, 3]  # the preempted one ahead of the new one
    victim = sched.waiting[0]
    assert victim.num_computed_tokens == 0 and not bm.has_sequence(2)
    assert victim.token_ids == [(2 * 7 + i) % 100 for i in range(3)] + [1]  # prompt + its generated token
    assert sched.num_preemptions == 1


def test_scheduler_frees_finished_blocks_at_once():
    bm, sched = make_scheduler(16, 4)
    sched.add(make_seq(0, 5, max_tokens=1))
    sched.add(make_seq(1, 5, max_tokens=2))
    _, finished = run_step(sched)
    assert [s.seq_id for s in finished] == [0] and finished[0].finish_reason == "length"
    assert not bm.has_sequence(0) and bm.num_used_blocks == 2 and [s.seq_id for s in sched.running] == [1]


def _queue_parent_of_three_and_two_singles(sched, prompt_len: int) -> None:
    """A parallel-sampling parent (seq 0, two children to fork: 10 and 11), then seqs 1 and 2 of 3 tokens."""
    parent = make_seq(0, prompt_len, n=3)
    parent.pending_children = [make_seq(10 + i, prompt_len, n=3, request_id=0) for i in range(2)]
    for i, child in enumerate(parent.pending_children):
        child.child_index = i + 1
        child.token_ids = list(parent.token_ids)
    sched.add(parent)
    sched.add(make_seq(1, 3))
    sched.add(make_seq(2, 3))


def test_a_parent_whose_prefill_spans_steps_keeps_its_childrens_seats():
    _, sched = make_scheduler(32, 4, max_num_seqs=4, max_num_batched_tokens=8)
    _queue_parent_of_three_and_two_singles(sched, 10)
    out, _ = run_step(sched)
    assert plan(out) == [(0, 0, 8)]  # the budget is spent on the parent's first chunk
    out, _ = run_step(sched)
    # running, its prefill not done, the parent still holds 3 seats (its children fork after this step's
    # chunk): seq 1 takes the 4th and seq 2 waits
    assert plan(out) == [(0, 8, 2), (1, 0, 3)] and [s.seq_id for s in sched.waiting] == [2]


def test_scheduler_seats_and_forks():
    bm, sched = make_scheduler(32, 4, max_num_seqs=4)
    _queue_parent_of_three_and_two_singles(sched, 6)
    out, _ = run_step(sched)
    # the parent takes 3 seats (itself + 2 children), seq 1 the 4th; seq 2 waits for a seat
    assert plan(out) == [(0, 0, 6), (1, 0, 3)] and [s.seq_id for s in sched.waiting] == [2]
    assert [s.seq_id for s in sched.running] == [0, 10, 11, 1]
    assert [bm.ref_count(b) for b in bm.block_table(0)] == [3, 3]
    assert bm.block_table(10) == bm.block_table(0)
    shared = bm.block_table(0)[1]  # the prompt's partial last block, held by all three
    out, _ = run_step(sched)
    # the first two writers copy it away (copy-on-write); the last one keeps it, now unshared
    copies = [(c.src, c.dst) for c in out.copies]
    assert copies == [(shared, bm.block_table(0)[1]), (shared, bm.block_table(10)[1])]
    assert bm.block_table(11)[1] == shared and bm.ref_count(shared) == 1
    assert len({bm.block_table(i)[1] for i in (0, 10, 11)}) == 3


def test_update_refuses_tokens_for_sequences_that_did_not_sample():
    """A token for a sequence mid-prompt (or unknown) is an executor bug, named rather than dropped."""
    _, sched = make_scheduler(32, 4, max_num_batched_tokens=6)
    for seq_id, n in ((0, 4), (1, 7)):
        sched.add(make_seq(seq_id, n))
    out = sched.schedule()  # seq 0's whole prompt samples; seq 1's first chunk does not
    with pytest.raises(RuntimeError, match="tokens for 2 sequences, of which 1 sampled"):
        sched.update(out, {0: 1, 1: 1})


def test_scheduler_preempts_and_readmits_a_request_all_or_nothing():
    """The paper's §4.5: when a forked child's copy-on-write finds no block, every sequence of the newest
    request goes (the sibling already planned this step too), and they come back together."""
    bm, sched = make_scheduler(6, 2)
    sched.add(make_seq(0, 4, max_tokens=2))  # 2 full blocks: its first decode needs a third
    parent = make_seq(1, 3, n=3)
    parent.pending_children = [Sequence(i, 1, i - 1, list(parent.token_ids), 3, parent.params, None)
                               for i in (2, 3)]
    sched.add(parent)
    out, _ = run_step(sched)
    assert plan(out) == [(0, 0, 4), (1, 0, 3)] and bm.num_free_blocks == 2
    assert [s.seq_id for s in sched.running] == [0, 1, 2, 3]  # children forked, sharing 2 blocks
    out, finished = run_step(sched)
    # seq 0 takes a block, seq 1 copies its shared block on write, seq 2 finds none: request 1 goes whole
    assert out.preempted_seq_ids == (1, 2, 3)
    assert plan(out) == [(0, 4, 1)]  # seq 1's decode, planned before seq 2 failed, is dropped
    assert out.copies == ()  # and so is its copy-on-write: its destination went back to the pool
    assert out.num_batched_tokens == 1  # and the token it was charged
    assert [s.seq_id for s in sched.waiting] == [1, 2, 3] and [s.seq_id for s in finished] == [0]
    assert bm.num_free_blocks == 6
    out, _ = run_step(sched)
    # all of them together; each recomputes past the prompt block the prefix cache kept
    assert plan(out) == [(1, 2, 2), (2, 2, 2), (3, 2, 2)]
    bm.check_invariants()


def test_the_only_running_request_is_preempted_whole():
    """When the newest request is the only one running (a parallel-sampling group), preemption takes every
    sequence of it, the first in the running list included, not just its tail."""
    bm, sched = make_scheduler(3, 2)
    parent = make_seq(1, 4, n=3)  # 2 full blocks, shared by the 3 children: each decode needs a block
    parent.pending_children = [Sequence(i, 1, i - 1, list(parent.token_ids), 4, parent.params, None)
                               for i in (2, 3)]
    sched.add(parent)
    run_step(sched)
    assert [s.seq_id for s in sched.running] == [1, 2, 3] and bm.num_free_blocks == 1
    out, _ = run_step(sched)  # seq 1 takes the last block, seq 2 finds none: the whole request goes
    assert out.preempted_seq_ids == (1, 2, 3)
    # recomputed apart the three can never fit together: they come back one by one, seq 1 at once (its
    # prompt's blocks still cached, only its last token to compute)
    assert plan(out) == [(1, 4, 1)] and [s.seq_id for s in sched.waiting] == [2, 3]


def test_scheduler_admits_a_request_whole_or_not_at_all():
    """A preempted request whose sequences fit the pool together waits until all of them fit; the refused
    attempt takes nothing."""
    bm, sched = make_scheduler(6, 2)
    sched.add(make_seq(0, 2, max_tokens=3))  # 1 block, grows to 2
    group = [make_seq(i, 4, request_id=1) for i in (1, 2, 3)]  # recomputed apart: 2 blocks each
    for i, s in enumerate(group):
        s.child_index = i
        sched.add(s)
    out, _ = run_step(sched)
    assert plan(out) == [(0, 0, 2)] and bm.num_free_blocks == 5  # 2 of 3 would fit: the group waits whole
    assert [s.seq_id for s in sched.waiting] == [1, 2, 3]


def test_decodes_stop_at_the_token_budget():
    """Forked children make more sequences ready to decode than the budget holds: a step schedules
    exactly the budget's worth, the rest wait for the next step."""
    _, sched = make_scheduler(32, 4, max_num_batched_tokens=2)
    parent = make_seq(0, 2, n=3)
    parent.pending_children = [make_seq(10 + i, 2, n=3, request_id=0) for i in range(2)]
    for i, child in enumerate(parent.pending_children):
        child.child_index, child.token_ids = i + 1, list(parent.token_ids)
    sched.add(parent)
    out, _ = run_step(sched)
    assert plan(out) == [(0, 0, 2)] and [s.seq_id for s in sched.running] == [0, 10, 11]
    out, _ = run_step(sched)
    assert plan(out) == [(0, 2, 1), (10, 2, 1)] and out.num_batched_tokens == 2


def test_a_prompt_finished_by_a_one_token_chunk_gets_no_extra_slot():
    """A chunked prompt whose last chunk is one token is planned like a decode, but its token already
    has room (allocated with the prompt): no slot is appended, so no block is taken early."""
    bm, sched = make_scheduler(32, 4, max_num_batched_tokens=7)
    sched.add(make_seq(0, 8))  # two full blocks
    out, _ = run_step(sched)
    assert plan(out) == [(0, 0, 7)] and len(bm.block_table(0)) == 2
    out, _ = run_step(sched)
    assert plan(out) == [(0, 7, 1)] and out.copies == ()
    assert len(bm.block_table(0)) == 2 and bm.num_used_blocks == 2 and sched.running[0].num_table_tokens == 8
    out, _ = run_step(sched)  # the first sampled token needs the third block
    assert plan(out) == [(0, 8, 1)] and len(bm.block_table(0)) == 3


def test_forked_children_reach_max_model_len_like_their_parent():
    """A parallel-sampling prompt one token short of max_model_len: the parent and the children it forks
    all keep their first token (max_model_len tokens is allowed) and finish on the next, as "length"."""
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, stop=StopRule(frozenset(), 5),
                      prefix_caching=True)
    parent = make_seq(0, 4, n=3, max_tokens=10)
    parent.pending_children = [make_seq(10 + i, 4, n=3, max_tokens=10, request_id=0) for i in range(2)]
    for i, child in enumerate(parent.pending_children):
        child.child_index, child.token_ids = i + 1, list(parent.token_ids)
    sched.add(parent)
    _, finished = run_step(sched)
    assert finished == [] and [len(s.token_ids) for s in sched.running] == [5, 5, 5]
    _, finished = run_step(sched)
    assert sorted(s.seq_id for s in finished) == [0, 10, 11]
    assert {(len(s.token_ids), s.finish_reason) for s in finished} == {(6, "length")}


def test_a_readmitted_group_past_the_token_budget_waits_for_its_chunk():
    """A preempted group comes back whole, but members past the step's token budget get no chunk (never an
    empty one): they compute in the next step."""
    _, sched = make_scheduler(6, 2)
    sched.add(make_seq(0, 4, max_tokens=2))
    parent = make_seq(1, 3, n=3)
    parent.pending_children = [Sequence(i, 1, i - 1, list(parent.token_ids), 3, parent.params, None)
                               for i in (2, 3)]
    sched.add(parent)
    run_step(sched)
    out, _ = run_step(sched)
    assert out.preempted_seq_ids == (1, 2, 3)
    sched.max_num_batched_tokens = 4  # room for two of the three members' 2-token chunks
    out, _ = run_step(sched)
    assert plan(out) == [(1, 2, 2), (2, 2, 2)] and out.num_batched_tokens == 4
    assert [s.seq_id for s in sched.running] == [1, 2, 3] and not sched.waiting
    out, _ = run_step(sched)
    assert (3, 2, 2) in plan(out)


@pytest.mark.parametrize("stop", ["eos", "stop"])
def test_min_tokens_ends_a_sequence_on_the_token_that_reaches_it(stop):
    """An EOS or stop token ends nothing before min_tokens output tokens, and ends the sequence on the very
    token that makes min_tokens."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, stop=StopRule(frozenset({99}), 64),
                      prefix_caching=True)
    params = SamplingParams(max_tokens=6, min_tokens=2, ignore_eos=False,
                            stop_token_ids=[98] if stop == "stop" else ())
    seq = Sequence(0, 0, 0, [5, 6, 7], 3, params, None)
    sched.add(seq)
    token = 99 if stop == "eos" else 98
    _, finished = run_step(sched, token)  # the first output token: below min_tokens
    assert finished == [] and seq.status is not SequenceStatus.FINISHED
    _, finished = run_step(sched, token)  # the second: min_tokens reached, and it ends the sequence
    assert [s.seq_id for s in finished] == [0] and seq.finish_reason == stop
    assert len(seq.token_ids) - 3 == 2 and bm.num_free_blocks == 8
