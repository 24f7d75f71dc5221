"""Unit tests of every block-manager operation and every error it raises.

Each rejected call is checked twice: the error type and message, and that nothing observable changed
(tables, token counts, ref counts, free count, free order, metrics).
"""

from __future__ import annotations

import pytest
from pagedbench.conformance.gate.block_manager_state import snapshot, without_failure_counter
from pagedbench.refengine.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    KVCacheError,
    OutOfBlocksError,
    UnknownSequenceError,
)


def _unchanged(bm, ids, call, error, match):
    """``call()`` raises ``error`` matching ``match`` and leaves ``bm`` exactly as it was."""
    before = snapshot(bm, ids)
    with pytest.raises(error, match=match):
        call()
    after = snapshot(bm, ids)
    if error is OutOfBlocksError:
        before, after = without_failure_counter(before), without_failure_counter(after)
    assert after == before
    bm.check_invariants()


@pytest.fixture(params=[False, True], ids=["no-prefix-cache", "prefix-cache"])
def bm(request, impl):
    """A manager of 6 blocks of 4 slots holding 'a' (6 tokens: blocks 0, 1)."""
    m = impl.block_manager(6, 4, enable_prefix_caching=request.param)
    m.allocate("a", [1, 2, 3, 4, 5, 6])
    return m


@pytest.mark.validation
@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (-1, 4), (4, 0), (4, -2), (2.0, 4), (4, "4")])
def test_constructor_rejects_bad_sizes(impl, num_blocks, block_size):
    with pytest.raises(InvalidArgumentError, match=r"must be an int >= 1, got"):
        impl.block_manager(num_blocks, block_size)


def test_fresh_manager(impl):
    m = impl.block_manager(5, 3)
    assert (m.num_blocks, m.block_size, m.num_free_blocks, m.num_used_blocks) == (5, 3, 5, 0)
    assert [m.ref_count(b) for b in range(5)] == [0] * 5
    assert m.free_block_ids() == [0, 1, 2, 3, 4]
    m.check_invariants()


@pytest.mark.parametrize("n, blocks", [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocate_table_length_and_slots(impl, n, blocks):
    m = impl.block_manager(8, 4)
    assert m.allocate(7, list(range(10, 10 + n))) == 0
    table = m.block_table(7)
    assert len(table) == blocks and m.num_tokens(7) == n
    assert [m.slot(7, p) for p in range(n)] == [table[p // 4] * 4 + p % 4 for p in range(n)]
    assert m.num_free_blocks == 8 - blocks and m.num_used_blocks == blocks
    assert all(m.ref_count(b) == 1 for b in table)
    m.check_invariants()


@pytest.mark.validation
@pytest.mark.parametrize("seq_id, error, match", [
    (None, InvalidArgumentError, "seq_id must not be None"),
    ([1], InvalidArgumentError, "seq_id must be hashable, got list"),
    ("a", DuplicateSequenceError, "sequence 'a' is already allocated"),
])
def test_allocate_rejects_bad_seq_id(bm, seq_id, error, match):
    _unchanged(bm, ["a"], lambda: bm.allocate(seq_id, [1, 2]), error, match)


@pytest.mark.validation
@pytest.mark.parametrize("tokens, match", [
    ([], "a prompt needs at least 1 token, got 0"),
    ([1, -1], r"token ids must be in \[0, 2\*\*63\), got -1"),
    ([1, 2**63], r"token ids must be in \[0, 2\*\*63\), got one >= 2\*\*63"),
    ([1, -(2**64)], r"token ids must be in \[0, 2\*\*63\), got -18446744073709551616"),  # past int64 too
    ([1, 2.5], "token_ids must be a sequence of ints"),
    ("abc", "token_ids must be a sequence of ints, got str"),
    ([1, True, 2], "token ids must be ints, got a bool"),
    ([False], "token ids must be ints, got a bool"),
])
def test_allocate_rejects_bad_tokens(bm, tokens, match):
    _unchanged(bm, ["a"], lambda: bm.allocate("b", tokens), InvalidArgumentError, match)
    assert not bm.has_sequence("b")


@pytest.mark.validation
def test_allocate_rejects_bad_salt(bm):
    _unchanged(bm, ["a"], lambda: bm.allocate("b", [1], cache_salt=3), InvalidArgumentError,
               "cache_salt must be str, bytes or None, got int")


def test_allocate_out_of_blocks_is_atomic(bm):
    # 4 blocks free; 17 tokens need 5
    _unchanged(bm, ["a"], lambda: bm.allocate("b", list(range(17))), OutOfBlocksError,
               r"sequence 'b' needs 5 free blocks \(17 tokens, 0 cached blocks reused\) but only 4 are free")
    assert bm.metrics().failed_allocations == 1 and not bm.has_sequence("b")
    assert bm.allocate("b", list(range(16))) == 0  # exactly the free blocks still fits
    assert bm.num_free_blocks == 0


def test_append_token_grows_at_block_edges(bm):
    assert bm.append_token("a", 7) == [] and bm.append_token("a", 8) == []
    assert len(bm.block_table("a")) == 2 and bm.num_tokens("a") == 8
    assert bm.append_token("a", 9) == []  # token 8 opens block 3
    table = bm.block_table("a")
    assert len(table) == 3 and bm.slot("a", 8) == table[2] * 4
    assert bm.num_free_blocks == 3
    bm.check_invariants()


@pytest.mark.validation
@pytest.mark.parametrize("seq_id, token, error, match", [
    ("zz", 1, UnknownSequenceError, "unknown sequence 'zz'"),
    ("a", -3, InvalidArgumentError, r"token id must be in \[0, 2\*\*63\), got -3"),
    ("a", "7", InvalidArgumentError, "token id must be an int, got str"),
    ("a", True, InvalidArgumentError, "token id must be an int, got bool True"),
    ({}, 1, InvalidArgumentError, "seq_id must be hashable, got dict"),
])
def test_append_token_rejects(bm, seq_id, token, error, match):
    _unchanged(bm, ["a"], lambda: bm.append_token(seq_id, token), error, match)


def test_append_token_out_of_blocks_is_atomic(impl):
    m = impl.block_manager(2, 2)
    m.allocate("a", [1, 2, 3, 4])
    assert not m.can_append("a")
    _unchanged(m, ["a"], lambda: m.append_token("a", 5), OutOfBlocksError,
               "sequence 'a' needs a new block for token 4 but none is free")


def test_fork_shares_every_block_and_cow_reports_the_copy(bm):
    bm.fork("a", "b")
    table = bm.block_table("a")
    assert bm.block_table("b") == table and bm.num_tokens("b") == 6
    assert [bm.ref_count(b) for b in table] == [2, 2] and bm.metrics().forks == 1
    copies = bm.append_token("b", 70)  # the partial last block is shared: b moves to a fresh one
    new_b = bm.block_table("b")
    assert copies == [(table[1], new_b[1])] and new_b[0] == table[0] and new_b[1] not in table
    assert bm.block_table("a") == table and [bm.ref_count(b) for b in table] == [2, 1]
    assert bm.append_token("a", 7) == []  # a's block is its own again: no copy
    assert bm.metrics().copy_on_write_copies == 1
    bm.check_invariants()


def test_fork_at_block_edge_needs_no_copy(impl):
    m = impl.block_manager(4, 2)
    m.allocate("a", [1, 2])
    m.fork("a", "b")
    assert m.append_token("b", 3) == [] and m.block_table("b")[0] == m.block_table("a")[0]
    assert m.metrics().copy_on_write_copies == 0


def test_copy_on_write_out_of_blocks_is_atomic(impl):
    m = impl.block_manager(2, 4)
    m.allocate("a", [1, 2, 3, 4, 5])  # 2 blocks, pool full
    m.fork("a", "b")
    assert not m.can_append("b")
    _unchanged(m, ["a", "b"], lambda: m.append_token("b", 6), OutOfBlocksError,
               "copy-on-write of shared block 1 needs a free block but none is free")


@pytest.mark.validation
@pytest.mark.parametrize("parent, child, error, match", [
    ("x", "b", UnknownSequenceError, "unknown sequence 'x'"),
    ("a", "a", DuplicateSequenceError, "sequence 'a' is already allocated"),
    ("a", None, InvalidArgumentError, "seq_id must not be None"),
])
def test_fork_rejects(bm, parent, child, error, match):
    _unchanged(bm, ["a"], lambda: bm.fork(parent, child), error, match)


def test_free_returns_blocks_and_rejects_double_free(bm):
    bm.fork("a", "b")
    bm.free("a")
    assert bm.num_free_blocks == 4 and all(bm.ref_count(b) == 1 for b in bm.block_table("b"))
    assert not bm.has_sequence("a") and bm.has_sequence("b")
    _unchanged(bm, ["b"], lambda: bm.free("a"), UnknownSequenceError, "unknown sequence 'a'")
    bm.free("b")
    assert bm.num_free_blocks == 6 and [bm.ref_count(b) for b in range(6)] == [0] * 6
    bm.check_invariants()


@pytest.mark.parametrize("op", ["free", "block_table", "num_tokens", "can_append"])
def test_unknown_sequence_raises_keyerror_subclass(bm, op):
    _unchanged(bm, ["a"], lambda: getattr(bm, op)(42), UnknownSequenceError, "unknown sequence 42")
    with pytest.raises(KeyError):
        getattr(bm, op)(42)
    with pytest.raises(KVCacheError):
        getattr(bm, op)(42)


@pytest.mark.validation
@pytest.mark.parametrize("position", [-1, 6, 100, 1.0])
def test_slot_rejects_positions_outside_the_sequence(bm, position):
    _unchanged(bm, ["a"], lambda: bm.slot("a", position), InvalidArgumentError,
               r"position must be an int in \[0, 6\) for sequence 'a'")


@pytest.mark.validation
@pytest.mark.parametrize("block_id", [-1, 6, 2.0])
def test_ref_count_rejects_out_of_range_ids(bm, block_id):
    _unchanged(bm, ["a"], lambda: bm.ref_count(block_id), InvalidArgumentError,
               r"block_id must be an int in \[0, 6\)")


def test_can_allocate_boundaries(bm):
    # 4 free blocks of 4 slots
    assert bm.can_allocate(0) and bm.can_allocate(15) and bm.can_allocate(16)
    assert not bm.can_allocate(17)
    with pytest.raises(InvalidArgumentError, match=r"num_tokens must be an int >= 0, got -1"):
        bm.can_allocate(-1)


def test_metrics_count_tokens_and_fragmentation(bm):
    bm.fork("a", "b")
    bm.append_token("b", 9)  # copy-on-write: b's block 1 is its own (3 tokens), a's keeps 2
    m = bm.metrics()
    assert (m.used_blocks, m.allocated_slots, m.live_tokens) == (3, 12, 4 + 2 + 3)
    assert m.internal_fragmentation_slots == 3 and m.num_sequences == 2
    assert m.used_blocks + m.free_blocks + m.cached_blocks == m.num_blocks
    assert bm.metrics_dict()["copy_on_write_copies"] == 1


@pytest.mark.validation
@pytest.mark.parametrize("num_tokens", [-1, 7, None])
def test_publish_blocks_rejects_bad_counts(bm, num_tokens):
    _unchanged(bm, ["a"], lambda: bm.publish_blocks("a", num_tokens), InvalidArgumentError,
               r"num_tokens must be an int in \[0, 6\] for sequence 'a'")


def test_publish_false_defers_prefix_hits(impl):
    m = impl.block_manager(8, 2, enable_prefix_caching=True)
    m.allocate("a", [1, 2, 3, 4, 5], publish=False)
    # a's KV is not written yet: a request in the same batch must not hit it (vLLM #7822)
    assert m.allocate("b", [1, 2, 3, 4, 5], publish=False) == 0
    m.free("b")
    m.publish_blocks("a", 2)  # block 0 written
    assert m.allocate("c", [1, 2, 3, 4, 5], publish=False) == 2
    m.publish_blocks("a", 5)
    assert m.allocate("d", [1, 2, 3, 4, 5]) == 4
    assert m.block_table("d")[:2] == m.block_table("a")[:2]
    m.check_invariants()


def test_check_invariants_names_a_corrupted_ref_count(impl):
    m = impl.block_manager(4, 2)
    m.allocate("a", [1, 2, 3])
    blocks = getattr(m, "_blocks", None)
    if blocks is None:
        pytest.skip("not supported: cannot corrupt this implementation's internals")
    blocks[m.block_table("a")[0]].ref_count += 1
    with pytest.raises(AssertionError, match="'ref counts' broken: block 0 has ref count 2 but 1 tables"):
        m.check_invariants()


def test_a_block_filled_by_append_is_cached_only_once_its_prompt_is_written(impl):
    m = impl.block_manager(12, 2, enable_prefix_caching=True)
    m.allocate("a", [1, 2, 3], publish=False)
    m.append_token("a", 4)  # block 1 is full, but tokens 0-2 are not written yet
    assert m.allocate("b", [1, 2, 3, 4, 9], publish=False) == 0
    m.publish_blocks("a", 4)
    assert m.allocate("c", [1, 2, 3, 4, 9]) == 4 and m.block_table("c")[:2] == m.block_table("a")
    m.append_token("a", 5)
    m.append_token("a", 6)  # block 2 is full, but the step writing tokens 4-5 has not run yet
    assert m.allocate("d", [1, 2, 3, 4, 5, 6, 0]) == 4  # a step that fails now poisons nothing
    m.publish_blocks("a", 6)
    assert m.allocate("e", [1, 2, 3, 4, 5, 6, 0]) == 6  # (block 2 may be d's twin, published first)
    m.check_invariants()


def test_a_block_filled_by_append_is_cached_as_it_fills(impl):
    """With ``publish=True`` (KV written as tokens come) the block an append fills is cached at once."""
    m = impl.block_manager(12, 4, enable_prefix_caching=True)
    m.allocate("a", [1, 2, 3])
    m.append_token("a", 4)  # block 0 is full
    assert m.allocate("b", [1, 2, 3, 4, 9]) == 4 and m.block_table("b")[0] == m.block_table("a")[0]
    m.check_invariants()


def test_token_ids_and_has_sequence(bm):
    tokens = bm.token_ids("a")
    assert tokens == [1, 2, 3, 4, 5, 6]
    tokens.append(99)  # a copy: the manager's state is untouched
    assert bm.num_tokens("a") == 6 and bm.token_ids("a") == [1, 2, 3, 4, 5, 6]
    assert bm.has_sequence("a") and not bm.has_sequence("b") and not bm.has_sequence([1])


def test_freed_published_blocks_are_counted_as_cached(impl):
    m = impl.block_manager(4, 2, enable_prefix_caching=True)
    m.allocate("a", [1, 2, 3, 4, 5])
    assert m.num_cached_blocks == 0
    m.free("a")  # blocks 0, 1 hold published KV; block 2 (partial) does not
    assert (m.num_free_blocks, m.num_cached_blocks, m.num_used_blocks) == (4, 2, 0)
    met = m.metrics()
    assert (met.free_blocks, met.cached_blocks, met.published_blocks) == (2, 2, 2)
