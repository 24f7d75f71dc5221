"""Exact-state scenarios: the block ids, free order and counters each step must produce.

Conventions pinned here (documented in refengine.block_manager): a fresh manager hands out blocks
0, 1, 2, ... in order; fresh blocks come from the uncached free blocks first (FIFO), and only then is
the least recently freed cached block evicted; a freed sequence's blocks are queued tail first. A prefix
hit covers at most ``(len(prompt) - 1) // block_size`` blocks, so the last prompt token is always
computed (and with it the logits the engine samples from).
"""

from __future__ import annotations

import pytest
from pagedbench.conformance.gate.block_manager_state import snapshot, without_failure_counter
from pagedbench.refengine.errors import OutOfBlocksError, UnknownSequenceError
from pagedbench.refengine.kv import prefix_hash


def _cached(impl, num_blocks, block_size):
    return impl.block_manager(num_blocks, block_size, enable_prefix_caching=True)


def test_eviction_is_lru_and_a_chains_tail_goes_first(impl):
    m = _cached(impl, 6, 2)
    assert m.allocate("A", [1, 2, 3, 4, 5]) == 0 and m.block_table("A") == [0, 1, 2]
    m.free("A")  # tail first: partial block 2 -> uncached; full blocks 1, 0 -> cached
    assert m.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert (m.num_free_blocks, m.num_cached_blocks) == (6, 2)
    # B needs 5 fresh blocks: the 4 uncached ones, then evicts A's tail (1), keeping A's head (0)
    assert m.allocate("B", list(range(10, 19))) == 0
    assert m.block_table("B") == [3, 4, 5, 2, 1] and m.metrics().evictions == 1
    m.free("B")  # B's partial block 1 -> uncached; its full blocks tail first: 2, 5, 4, 3
    assert m.free_block_ids() == [1, 0, 2, 5, 4, 3]
    # C hits A's head (block 0, older than B's blocks but revived from the middle of the queue),
    # then takes the uncached block 1 and evicts B's tail (2), not B's head (3)
    assert m.allocate("C", [1, 2, 3, 4, 5]) == 2
    assert m.block_table("C") == [0, 1, 2] and m.metrics().evictions == 2
    assert m.free_block_ids() == [5, 4, 3] and m.ref_count(0) == 1
    m.check_invariants()


def test_failed_allocation_with_cached_hits_is_atomic(impl):
    m = _cached(impl, 4, 2)
    m.allocate("A", [1, 2, 3, 4, 5])  # blocks 0, 1, 2
    m.free("A")  # free order [3, 2, 1, 0]; 1 and 0 cached
    m.allocate("B", [7, 8])  # block 3
    before = snapshot(m, ["B"])
    # hits blocks 0, 1 (both cached free), then needs 3 fresh blocks: only 1 remains (block 2)
    with pytest.raises(OutOfBlocksError, match=r"needs 3 free blocks \(10 tokens, 2 cached blocks reused\) "
                                               r"but only 1 are free"):
        m.allocate("C", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    after = snapshot(m, ["B"])
    assert without_failure_counter(after) == without_failure_counter(before)
    assert after["free_order"] == [2, 1, 0] and after["metrics"]["evictions"] == 0
    assert after["metrics"]["prefix_query_tokens"] == 5 + 2  # the failed query is not counted
    assert m.metrics().failed_allocations == 1
    assert m.allocate("C", [1, 2, 3, 4, 5]) == 4 and m.block_table("C") == [0, 1, 2]
    m.check_invariants()


@pytest.mark.parametrize("salt_a, salt_b, hit", [
    ("tenant-1", "tenant-1", True), (None, None, True), (b"k", b"k", True),
    ("tenant-1", "tenant-2", False), (None, "", False), ("k", b"k", False), (None, "tenant-1", False),
])
def test_same_salt_hits_and_different_salt_misses(impl, salt_a, salt_b, hit):
    m = _cached(impl, 12, 2)
    m.allocate("A", [1, 2, 3, 4, 5], cache_salt=salt_a)
    assert m.allocate("B", [1, 2, 3, 4, 5], cache_salt=salt_b) == (4 if hit else 0)
    shared = set(m.block_table("A")) & set(m.block_table("B"))
    assert shared == ({0, 1} if hit else set())
    # each tenant's chain is cached under its own hash: both are reusable side by side
    assert m.allocate("A2", [1, 2, 3, 4, 9], cache_salt=salt_a) == 4
    assert m.allocate("B2", [1, 2, 3, 4, 9], cache_salt=salt_b) == 4
    assert m.block_table("B2")[:2] == m.block_table("B")[:2]
    m.check_invariants()


def test_root_hash_separates_salts():
    roots = [prefix_hash.root_hash(s) for s in (None, "", b"", "a", b"a", "b")]
    assert len(set(roots)) == len(roots)


def test_double_free_and_unknown_free_change_nothing(impl):
    m = _cached(impl, 4, 2)
    m.allocate("A", [1, 2, 3])
    m.allocate("B", [4])
    m.free("A")
    before = snapshot(m, ["B"])
    for seq_id in ("A", "never"):
        with pytest.raises(UnknownSequenceError, match=f"unknown sequence '{seq_id}'"):
            m.free(seq_id)
    assert snapshot(m, ["B"]) == before and before["free_order"] == [3, 1, 0]
    m.check_invariants()


def test_fork_and_copy_on_write_report_exact_copies(impl):
    m = impl.block_manager(8, 4)
    m.allocate("A", [1, 2, 3, 4, 5, 6])  # [0, 1]
    m.fork("A", "B")
    m.fork("A", "C")
    assert [m.ref_count(b) for b in (0, 1)] == [3, 3]
    assert m.append_token("B", 7) == [(1, 2)] and m.block_table("B") == [0, 2]
    assert m.append_token("C", 7) == [(1, 3)] and m.block_table("C") == [0, 3]
    assert m.append_token("A", 7) == []  # block 1 is A's alone now
    assert [m.ref_count(b) for b in range(4)] == [3, 1, 1, 1]
    assert m.append_token("B", 8) == [] and m.append_token("B", 9) == []  # B opens block 4
    assert m.block_table("B") == [0, 2, 4]
    assert m.metrics().copy_on_write_copies == 2 and m.metrics().forks == 2
    m.free("A")
    m.free("C")
    assert m.free_block_ids() == [5, 6, 7, 1, 3] and m.ref_count(0) == 1
    m.check_invariants()


@pytest.mark.parametrize("bs", [1, 3, 16])
@pytest.mark.parametrize("edge", [-1, 0, 1], ids=["N-1", "N", "N+1"])
def test_tokens_around_block_edges(impl, bs, edge):
    n = 2 * bs + edge
    if n < 1:
        pytest.skip("no prompt is shorter than 1 token")
    m = impl.block_manager(4, bs)
    m.allocate("s", list(range(n)))
    assert len(m.block_table("s")) == -(-n // bs) and m.num_free_blocks == 4 - (-(-n // bs))
    before = list(m.block_table("s"))
    m.append_token("s", 0)
    table = m.block_table("s")
    assert table[:len(before)] == before and len(table) == -(-(n + 1) // bs)
    assert m.slot("s", n) == table[n // bs] * bs + n % bs
    assert [m.slot("s", p) for p in range(n + 1)] == [table[p // bs] * bs + p % bs for p in range(n + 1)]
    m.check_invariants()


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_full_pool(impl, bs):
    m = impl.block_manager(3, bs)
    m.allocate("a", list(range(3 * bs)))
    assert m.num_free_blocks == 0 and not m.can_allocate(1) and m.can_allocate(0)
    assert not m.can_append("a")
    with pytest.raises(OutOfBlocksError):
        m.append_token("a", 1)
    with pytest.raises(OutOfBlocksError):
        m.allocate("b", [1])
    m.free("a")
    assert m.num_free_blocks == 3 and m.can_allocate(3 * bs) and not m.can_allocate(3 * bs + 1)
    m.check_invariants()


@pytest.mark.parametrize("bs", [1, 3, 16])
@pytest.mark.parametrize("extra, expected_blocks", [(0, 1), (1, 2)], ids=["last-block-full", "partial"])
def test_prefix_hit_never_covers_the_last_prompt_token(impl, bs, extra, expected_blocks):
    """A prompt of 2 full blocks reuses 1 block (its last block is recomputed); with 1 more token, 2."""
    m = _cached(impl, 8, bs)
    m.allocate("A", list(range(2 * bs)))
    prompt = list(range(2 * bs)) + [7] * extra
    hit = m.allocate("B", prompt)
    assert hit == expected_blocks * bs and hit <= len(prompt) - 1
    assert m.block_table("B")[:expected_blocks] == m.block_table("A")[:expected_blocks]
    assert m.block_table("B")[expected_blocks] not in m.block_table("A")
    assert m.metrics().prefix_hit_tokens == hit
    m.check_invariants()


def test_one_token_prompt_never_hits(impl):
    m = _cached(impl, 4, 1)
    m.allocate("A", [5])
    assert m.allocate("B", [5]) == 0 and m.block_table("B") == [1]


def test_hash_collision_never_serves_another_prompts_kv(impl, monkeypatch):
    monkeypatch.setattr(prefix_hash, "block_hash", lambda parent, tokens: b"\x00" * 32)  # all collide
    m = _cached(impl, 10, 2)
    m.allocate("A", [1, 2, 3, 4, 5])
    assert m.allocate("B", [7, 8, 9, 10, 11]) == 0  # same hash, other tokens: a miss
    assert m.allocate("C", [1, 2, 3, 4, 5], cache_salt="other") == 0  # same hash and tokens, other salt
    assert not set(m.block_table("A")) & (set(m.block_table("B")) | set(m.block_table("C")))
    m.check_invariants()


def test_collision_at_the_parent_is_caught_by_the_parent_check(impl, monkeypatch):
    """(1, 2) and (3, 4) collide at the root; a cached child of (3, 4) must not follow a hit on (1, 2)."""
    real = prefix_hash.block_hash
    monkeypatch.setattr(prefix_hash, "block_hash",
                        lambda parent, tokens: real(parent, (3, 4) if tuple(tokens) == (1, 2) else tokens))
    m = _cached(impl, 8, 2)
    m.allocate("S1", [3, 4, 9], publish=False)  # blocks [0, 1]
    m.allocate("S2", [3, 4, 5, 6, 9], publish=False)  # blocks [2, 3, 4]: its own copy of (3, 4)
    m.publish_blocks("S1", 2)  # (3, 4) cached in block 0
    m.publish_blocks("S2", 4)  # (3, 4) already cached: block 2 is its twin; (5, 6) in block 3
    m.free("S1")  # block 0 cached, free order [5, 6, 7, 1, 0]
    m.allocate("U", list(range(30, 40)))  # 5 blocks: the 4 uncached, then evicts block 0
    assert m.block_table("U") == [5, 6, 7, 1, 0] and m.metrics().evictions == 1
    m.free("U")
    # (1, 2) hashes as (3, 4), whose KV lives on in block 2: the token check refuses it, and (1, 2)
    # cannot be published under that hash while (3, 4) is cached
    assert m.allocate("X", [1, 2, 7]) == 0
    m.free("S2")  # (5, 6) in block 3 stays cached, a child of (3, 4)
    # a token-only check at (1, 2) would lead on to block 3, whose KV was computed after (3, 4)
    assert m.allocate("Q", [1, 2, 5, 6, 9]) == 0
    assert 3 not in m.block_table("Q")
    assert m.allocate("R", [3, 4, 5, 6, 9]) == 4 and m.block_table("R")[:2] == [2, 3]  # the twin serves
    m.check_invariants()


def test_identical_prompts_admitted_together_keep_their_reuse(impl):
    """Two requests with one prompt, admitted in one step, compute its KV twice. When the first finishes
    and its cached blocks are evicted, the survivor's copy must still serve a prompt equal to its
    computed tokens (vLLM and nano-vllm reuse all of it); losing it is no wrong data, but lost reuse."""
    bs = 4
    m = impl.block_manager(12, bs, enable_prefix_caching=True)
    prompt = list(range(1, 13))  # 3 full blocks
    for seq in ("a", "b"):
        m.allocate(seq, prompt, publish=False)
    for seq in ("a", "b"):
        m.publish_blocks(seq, 12)
    m.free("a")
    for i in range(9):  # the 6 uncached blocks, then a's 3 cached ones, evicted
        m.allocate(("filler", i), [100 + i], publish=False)
    assert m.metrics().evictions == 3
    m.free(("filler", 0))  # room for c's last block
    m.check_invariants()
    assert m.allocate("c", [*prompt, 99]) == 12
    assert m.block_table("c")[:3] == m.block_table("b")
    m.check_invariants()
