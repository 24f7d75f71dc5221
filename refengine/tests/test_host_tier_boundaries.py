"""The host tiers at their edges, without a model: a prefix-cache tier of a single block, a host pool
handed out to its last block, and a host size that uses exactly the memory available."""

from __future__ import annotations

import pytest
from pagedbench.refengine.errors import InsufficientMemoryError
from pagedbench.refengine.kv import prefix_hash
from pagedbench.refengine.kv.block_manager import BlockManager
from pagedbench.refengine.kv.host_pool import GIB, HostBlockAllocator, checked_host_space_bytes


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


def test_a_host_size_that_uses_exactly_the_available_memory_is_accepted():
    assert checked_host_space_bytes("swap_space", 2, 2 * GIB) == 2 * GIB
    assert checked_host_space_bytes("kv_offloading_size", 1, 3 * GIB, also_bytes=2 * GIB, also="swap_space") == GIB
    with pytest.raises(InsufficientMemoryError, match=r"needs 1,073,741,824 bytes of host memory \(beside "
                                                      r"swap_space's 2,147,483,649\)"):
        checked_host_space_bytes("kv_offloading_size", 1, 3 * GIB, also_bytes=2 * GIB + 1, also="swap_space")
