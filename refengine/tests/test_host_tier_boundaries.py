"""The host tiers' bookkeeping at its edges, without a model: a prefix-cache tier of a single block, its LRU
order after a host hit, a chain running across both tiers, a failed step's undo of its loads, a host pool
handed out to its last block, a host size that uses exactly the memory available, and a swap-in that
needs every free device block."""

from __future__ import annotations

import pytest
from pagedbench.refengine import SamplingParams
from pagedbench.refengine.engine.host_memory_arguments import GIB, checked_host_space_bytes
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule
from pagedbench.refengine.engine.sequence import Sequence
from pagedbench.refengine.errors import InsufficientMemoryError, OutOfBlocksError
from pagedbench.refengine.kv import prefix_hash
from pagedbench.refengine.kv.block_manager import BlockManager
from pagedbench.refengine.kv.host_pool import HostBlockAllocator


def block_key(tokens: tuple) -> bytes:
    return prefix_hash.block_hash(prefix_hash.root_hash(None), tokens)


def serve(bm: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """One prompt's step with its copies committed, then the prompt freed; returns its hit tokens."""
    hit = bm.allocate(seq_id, tokens)
    bm.take_offload_copies()
    bm.commit_offload_step()
    bm.free(seq_id)
    bm.check_invariants()
    return hit


def test_a_tier_of_one_block_keeps_the_last_block_the_device_evicted():
    """Device pool of 2 blocks of 2: each prompt [i, i, 99] publishes (i, i) and evicts the previous one's."""
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_host_blocks=1)
    tier = bm.host_tier
    for i in (1, 2, 3):
        serve(bm, i, [i, i, 99])
    # (1, 1) stored, then (2, 2) in its place
    assert tier.hashes() == [block_key((2, 2))] and tier.num_evictions == 1
    # a host hit; the (3, 3) it evicts from the device finds the one entry pinned by the load: dropped
    assert serve(bm, 4, [2, 2, 99]) == 2, "the one host entry serves its prefix"
    assert tier.hashes() == [block_key((2, 2))] and tier.num_dropped_stores == 1 and tier.num_free_blocks == 0
    tier.check()


def test_the_host_allocator_hands_out_its_last_block_and_refuses_one_more():
    host = HostBlockAllocator(3)
    assert host.take(2) == [0, 1]
    assert host.take(1) == [2] and host.num_free_blocks == 0  # exactly the blocks left
    with pytest.raises(InsufficientMemoryError, match="1 host blocks wanted, 0 free"):
        host.take(1)
    host.release([1, 0])
    assert host.take(2) == [1, 0]  # FIFO: released blocks come back in the order they were released
    host.release([2])
    with pytest.raises(AssertionError, match="host block 2 released twice"):
        host.release([0, 2])
    assert host.num_free_blocks == 1, "a refused release freed a block"
    with pytest.raises(AssertionError, match="host block 0 released twice"):
        host.release([0, 0])  # twice in one call: the id would be handed out to two groups
    assert host.num_free_blocks == 1, "a refused release freed a block"


def test_a_host_size_that_uses_exactly_the_available_memory_is_accepted():
    assert checked_host_space_bytes("swap_space", 2, 2 * GIB) == 2 * GIB
    assert checked_host_space_bytes("kv_offloading_size", 1, 3 * GIB, also_bytes=2 * GIB, also="swap_space") == GIB
    with pytest.raises(InsufficientMemoryError, match=r"needs 1,073,741,824 bytes of host memory \(beside "
                                                      r"swap_space's 2,147,483,649\)"):
        checked_host_space_bytes("kv_offloading_size", 1, 3 * GIB, also_bytes=2 * GIB + 1, also="swap_space")


def test_a_swap_in_that_needs_every_free_block_fits_and_one_more_is_refused():
    bm = BlockManager(4, 2)
    bm.allocate("a", [1, 2, 3])  # two blocks
    tables = bm.swap_out(["a"])
    bm.allocate("b", [5, 6, 7, 8])  # two blocks: exactly the two the swap-in needs are left
    placed = bm.swap_in(tables)
    assert len(placed) == 2 and bm.num_free_blocks == 0 and bm.block_table("a") == [d for _, d in placed]
    bm.check_invariants()
    tables = bm.swap_out(["a"])
    bm.allocate("c", [9])  # one of the two blocks it needs taken
    with pytest.raises(OutOfBlocksError, match="swap-in needs 2 free blocks but only 1 are free"):
        bm.swap_in(tables)
    assert not bm.has_sequence("a") and bm.num_free_blocks == 1
    bm.check_invariants()


def test_a_host_hit_makes_its_entry_the_most_recently_used():
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_host_blocks=3)
    for i in (1, 2, 3):
        serve(bm, i, [i, i, 99])
    assert bm.host_tier.hashes() == [block_key((1, 1)), block_key((2, 2))]
    assert serve(bm, 4, [1, 1, 99]) == 2  # a host hit on the least recently used entry; (3, 3) stored
    assert bm.host_tier.hashes() == [block_key((2, 2)), block_key((1, 1)), block_key((3, 3))]


def test_a_block_computed_again_while_its_hash_is_on_the_host_keeps_the_chain_across_the_tiers():
    bm = BlockManager(3, 2, enable_prefix_caching=True, num_host_blocks=4)
    serve(bm, 1, [1, 1, 2, 2, 9])
    serve(bm, 2, [5, 5, 6, 6, 7])  # (1, 1) and (2, 2) evicted to the host
    assert {block_key((1, 1))} <= set(bm.host_tier.hashes())
    assert serve(bm, 3, [1, 1]) == 0  # (no hit on a prompt's last block) (1, 1) computed on the device again
    # (1, 1) hit on the device, (2, 2) on the host: its parent is the device block, by the same content id
    assert serve(bm, 4, [1, 1, 2, 2, 9]) == 4


def test_a_failed_step_s_loads_preempt_only_the_sequences_that_hold_a_loaded_block():
    """A running decode left without a chunk (the "separate" policy runs the step's prefills alone) holds no
    block the failed step loaded from the host: it keeps running, its blocks untouched."""
    bm = BlockManager(8, 4, enable_prefix_caching=True, num_host_blocks=8)
    prompt = list(range(1, 14))  # three full blocks and the last token
    serve(bm, "p", prompt)
    serve(bm, "filler", list(range(100, 132)))  # the whole pool: the prompt's blocks go to the host
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, stop=StopRule(frozenset(), 64),
                      prefix_caching=True, policy="separate")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    decoding = Sequence(9, 9, 0, [200, 201], 2, params, None)
    sched.add(decoding)
    sched.update(sched.schedule(), {9: 5})
    table = bm.block_table(9)
    for i in range(2):
        sched.add(Sequence(i, 0, i, list(prompt), len(prompt), params, None))
    out = sched.schedule()
    assert len(out.offload_load) == 3 and [c.seq.seq_id for c in out.chunks] == [0, 1]
    sched.roll_back()
    assert sched.running == [decoding] and sorted(s.seq_id for s in sched.waiting) == [0, 1]
    assert bm.block_table(9) == table and decoding.num_computed_tokens == 2 and decoding.num_preemptions == 0
    bm.check_invariants()


def test_a_block_evicted_before_its_load_ran_leaves_the_host_tier_as_it_was():
    """A host hit's device block freed and evicted in the step that loads it (its sequence preempted, say)
    has no KV yet: the tier stores nothing for it and does not touch its entry."""
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_host_blocks=3)
    for i in (1, 2, 3):
        serve(bm, i, [i, i, 99])
    assert bm.allocate(4, [1, 1, 99]) == 2  # loads (1, 1), stores (3, 3): LRU order (2, 2), (1, 1), (3, 3)
    bm.free(4)
    bm.allocate(5, [7, 7, 99])  # evicts the block (1, 1) is being loaded into, before the load ran
    stores, loads = bm.take_offload_copies()
    assert len(stores) == 1 and len(loads) == 1
    assert bm.host_tier.hashes() == [block_key((2, 2)), block_key((1, 1)), block_key((3, 3))]
    bm.commit_offload_step()
    bm.free(5)
    bm.check_invariants()


def test_a_block_manager_without_a_host_tier_plans_no_host_copies():
    bm = BlockManager(2, 2, enable_prefix_caching=True)
    for i in (1, 2, 3):
        serve(bm, i, [i, i, 99])  # evictions with nowhere to store them
    assert bm.host_tier is None and bm.take_offload_copies() == ([], [])
    assert bm.undo_offload_step() == []
    bm.check_invariants()


def test_a_failed_step_whose_loaded_block_was_evicted_again_undoes_cleanly():
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_host_blocks=3)
    for i in (1, 2, 3):
        serve(bm, i, [i, i, 99])
    bm.allocate(4, [1, 1, 99])  # loads (1, 1) into a fresh block, stores (3, 3)
    loaded = bm.block_table(4)[0]
    bm.free(4)
    bm.allocate(5, [7, 7, 99])  # the loaded block evicted again (its identity gone) and taken by seq 5
    bm.take_offload_copies()
    assert bm.undo_offload_step() == [loaded]  # seq 5 holds it now: the caller frees its table
    assert bm.host_tier.hashes() == [block_key((2, 2)), block_key((1, 1))], "the step's store (3, 3) is dropped"
    bm.free(5)
    bm.check_invariants()
    assert serve(bm, 6, [1, 1, 99]) == 2  # the entry whose load failed is still good
