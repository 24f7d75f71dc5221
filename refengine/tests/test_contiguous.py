"""Orca reservation policies and ContiguousBlockManager: exact placements, accounting, errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pagedbench.refengine import ContiguousBlockManager
from pagedbench.refengine.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidRequestError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from pagedbench.refengine.kv.contiguous import ForkNotSupportedError, next_power_of_two, reservation


def snapshot(m: ContiguousBlockManager, seq_ids=("a", "b", "c", "d")) -> tuple:
    tables = {s: (m.block_table(s), m.num_tokens(s)) for s in seq_ids if m.has_sequence(s)}
    return tables, m.metrics(), [m.ref_count(b) for b in range(m.num_blocks)]


# --- policies -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,prompt,output,expected", [
    ("max", 10, 25, 2048),
    ("pow2", 10, 25, 10 + 32),  # the vLLM paper's example: a true output of 25 reserves 32
    ("pow2", 10, 32, 10 + 32),
    ("pow2", 10, 33, 10 + 64),
    ("pow2", 10, 1, 11),
    ("pow2", 2000, 40, 2048),  # 2000 + 64 capped at max_seq_len
    ("oracle", 10, 25, 35),
    ("oracle", 2000, 48, 2048),
])
def test_reservation(policy, prompt, output, expected):
    assert reservation(policy, prompt, output, 2048) == expected


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (1, 2, 3, 25, 32, 33, 1000)] == [1, 2, 4, 32, 32, 64, 1024]


@pytest.mark.parametrize("args,match", [
    (("best", 10, 25, 2048), "policy must be one of max, pow2, oracle; got 'best'"),
    (("max", 2000, 49, 2048), "prompt_len \\+ output_len = 2000 \\+ 49 exceeds max_seq_len 2048"),
    (("pow2", 0, 5, 2048), "prompt_len must be >= 1, got 0"),
    (("oracle", 5, 0, 2048), "output_len must be >= 1, got 0"),
])
def test_reservation_errors(args, match):
    with pytest.raises(InvalidArgumentError, match=match):
        reservation(*args)


# --- the manager --------------------------------------------------------------------------------
def test_max_policy_buddy_exact_state():
    m = ContiguousBlockManager(16, 4, max_seq_len=16)  # every request reserves 16 slots = 4 blocks
    assert m.allocate("a", [1, 2, 3, 4, 5]) == 0
    assert m.allocate("b", [7]) == 0
    assert m.block_table("a") == [0, 1] and m.block_table("b") == [4]
    assert m.slot("a", 4) == 4 and m.slot("b", 0) == 16
    assert m.num_free_blocks == 8 and m.num_used_blocks == 8
    assert [m.ref_count(b) for b in range(8)] == [1] * 8 and m.ref_count(8) == 0
    for _ in range(3):
        assert m.append_token("a", 9) == []
    assert m.block_table("a") == [0, 1] and m.num_tokens("a") == 8
    assert m.append_token("a", 9) == [] and m.block_table("a") == [0, 1, 2]
    met = m.metrics()
    assert (met.num_tokens, met.reserved_slots, met.rounding_waste_slots) == (10, 32, 0)
    assert met.internal_fragmentation_slots == 22 and met.num_sequences == 2
    m.check_invariants()
    m.free("a")
    assert m.num_free_blocks == 12 and m.allocate("c", [1]) == 0 and m.block_table("c") == [0]
    m.check_invariants()


def test_append_past_the_reservation_raises_and_changes_nothing():
    m = ContiguousBlockManager(8, 2, max_seq_len=4)
    m.allocate("a", [1, 2, 3])
    m.append_token("a", 4)
    assert not m.can_append("a")
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match="'a' has used its whole reservation of 4 tokens"):
        m.append_token("a", 5)
    assert snapshot(m) == before


def test_pow2_policy_rounds_in_the_buddy():
    m = ContiguousBlockManager(16, 4, max_seq_len=64, policy="pow2")
    m.allocate("a", [1, 2, 3], output_len=5)  # 3 + 8 = 11 tokens -> 3 blocks -> buddy block of 4
    assert m.reserved_tokens("a") == 11 and m.held_blocks("a") == 4
    assert m.footprint_blocks(3, output_len=5) == 4 and m.footprint_blocks(3, output_len=1) == 1
    assert [m.ref_count(b) for b in range(4)] == [1, 1, 1, 0]  # the rounded-up block is held, not used
    met = m.metrics()
    assert (met.num_used_blocks, met.reserved_slots, met.rounding_waste_slots) == (4, 12, 4)
    assert met.internal_fragmentation_slots == 16 - 3
    m.allocate("b", [1] * 10, output_len=2)  # 10 + 2 = 12 tokens -> 3 blocks -> buddy block at 4
    assert m.block_table("b") == [4, 5, 6]


def test_first_fit_places_exact_runs():
    m = ContiguousBlockManager(10, 4, max_seq_len=64, policy="oracle", placement="first_fit")
    m.allocate("a", [1] * 5, output_len=7)  # 12 tokens -> 3 blocks at 0
    m.allocate("b", [1] * 2, output_len=2)  # 4 tokens -> 1 block at 3
    m.allocate("c", [1] * 9, output_len=3)  # 3 blocks at 4
    assert (m.block_table("a"), m.block_table("b"), m.block_table("c")) == ([0, 1], [3], [4, 5, 6])
    m.free("a")
    assert m.num_free_blocks == 6 and not m.can_allocate(1, output_len=15)  # 4 blocks: holes of 3 and 3
    assert m.can_allocate(1, output_len=11) and not m.can_allocate(1, output_len=12)  # 13 tokens: 4 blocks
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError,
                       match=r"no hole of 4 consecutive blocks .* 6 blocks free, largest hole 3"):
        m.allocate("d", [1], output_len=15)
    after = snapshot(m)
    assert after[0] == before[0] and after[2] == before[2]
    assert after[1].failed_allocations == before[1].failed_allocations + 1  # the only change: a counter
    m.allocate("d", [1], reserve_tokens=12)  # an explicit reservation overrides the policy
    assert m.block_table("d") == [0] and m.reserved_tokens("d") == 12
    m.check_invariants()


@pytest.mark.parametrize("call,error,match", [
    (lambda m: m.allocate("a", [1]), DuplicateSequenceError, "sequence 'a' is already allocated"),
    (lambda m: m.allocate(None, [1]), InvalidArgumentError, "seq_id must not be None"),
    (lambda m: m.allocate("x", []), InvalidArgumentError, "token_ids must not be empty"),
    (lambda m: m.allocate("x", [1, -3]), InvalidArgumentError, "non-negative ints, got -3"),
    (lambda m: m.allocate("x", [1] * 17), InvalidArgumentError, "prompt of 17 tokens exceeds max_seq_len 16"),
    (lambda m: m.allocate("x", [1, 2], reserve_tokens=1), InvalidArgumentError,
     r"reserve_tokens must be in \[2 \(the prompt\), 16 \(max_seq_len\)\], got 1"),
    (lambda m: m.append_token("x", 1), UnknownSequenceError, "unknown sequence 'x'"),
    (lambda m: m.append_token("a", -1), InvalidArgumentError, "non-negative int, got -1"),
    (lambda m: m.free("x"), UnknownSequenceError, "unknown sequence 'x'"),
    (lambda m: m.block_table("x"), UnknownSequenceError, "unknown sequence 'x'"),
    (lambda m: m.slot("a", 2), InvalidArgumentError, r"position must be in \[0, 2\), got 2"),
    (lambda m: m.ref_count(16), InvalidArgumentError, r"block id must be in \[0, 16\), got 16"),
    (lambda m: m.fork("a", "b"), ForkNotSupportedError, "does not support fork"),
])
def test_errors_leave_state_unchanged(call, error, match):
    m = ContiguousBlockManager(16, 4, max_seq_len=16)
    m.allocate("a", [1, 2])
    before = snapshot(m)
    with pytest.raises(error, match=match):
        call(m)
    assert snapshot(m) == before
    m.check_invariants()


def test_fork_error_is_an_invalid_request_and_not_implemented():
    assert issubclass(ForkNotSupportedError, InvalidRequestError)
    assert issubclass(ForkNotSupportedError, NotImplementedError)


def test_pow2_without_output_length_is_an_error():
    m = ContiguousBlockManager(16, 4, max_seq_len=16, policy="pow2")
    with pytest.raises(InvalidArgumentError, match="policy 'pow2' needs the request's output length"):
        m.allocate("a", [1])
    assert m.num_free_blocks == 16 and not m.has_sequence("a")


def test_double_free_raises():
    m = ContiguousBlockManager(4, 1, max_seq_len=2)
    m.allocate("a", [1])
    m.free("a")
    with pytest.raises(UnknownSequenceError):
        m.free("a")
    assert m.num_free_blocks == 4


def test_check_invariants_catches_drift():
    m = ContiguousBlockManager(16, 4, max_seq_len=16)
    m.allocate("a", [1, 2])
    m._seqs["a"].num_tokens = 17  # corrupt: more tokens than the reservation
    with pytest.raises(AssertionError, match="outside its reservation"):
        m.check_invariants()


@pytest.mark.parametrize("kw,match", [
    ({"policy": "best"}, "policy must be one of"),
    ({"placement": "best"}, "placement must be 'buddy' or 'first_fit'"),
    ({"max_seq_len": 0}, "max_seq_len must be >= 1, got 0"),
])
def test_bad_construction(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        ContiguousBlockManager(16, 4, **{"max_seq_len": 16, **kw})


CONTRACT = ("allocate", "append_token", "fork", "free", "block_table", "num_tokens", "slot",
            "can_allocate", "can_append", "ref_count", "num_free_blocks", "num_used_blocks",
            "num_cached_blocks", "num_blocks", "block_size", "check_invariants", "has_sequence", "metrics")


def test_speaks_the_block_managers_interface():
    from pagedbench.refengine import BlockManager

    paged, contiguous = BlockManager(8, 4), ContiguousBlockManager(8, 4, max_seq_len=8)
    for name in CONTRACT:
        assert hasattr(paged, name) and hasattr(contiguous, name), name
    for m in (paged, contiguous):  # the calls the engine's scheduler makes, with the same arguments
        assert m.can_allocate(3) and m.allocate("s", [1, 2, 3]) == 0
        assert m.append_token("s", 4) == [] and m.block_table("s") == [m.block_table("s")[0]]
        assert m.num_tokens("s") == 4 and m.slot("s", 3) == m.block_table("s")[0] * 4 + 3
        m.free("s")
        assert not m.has_sequence("s") and m.num_free_blocks == 8


OPS = st.lists(st.tuples(st.sampled_from(["alloc", "append", "free"]), st.integers(1, 12),
                         st.integers(0, 99)), max_size=50)


@given(placement=st.sampled_from(["buddy", "first_fit"]), policy=st.sampled_from(["max", "pow2", "oracle"]),
       ops=OPS)
def test_random_operations_keep_reservations_disjoint(placement, policy, ops):
    m = ContiguousBlockManager(13, 2, max_seq_len=12, policy=policy, placement=placement)
    live: dict[int, int] = {}  # seq id -> tokens
    for i, (op, n, pick) in enumerate(ops):
        if op == "alloc":
            prompt = min(n, 11)
            output = 1 + pick % (12 - prompt)  # prompt + output <= max_seq_len
            kw = {} if policy == "max" else {"output_len": output}
            fits = m.can_allocate(prompt, **kw)
            try:
                m.allocate(i, [0] * prompt, **kw)
                live[i] = prompt
            except OutOfBlocksError:
                assert not fits
            else:
                assert fits
        elif live:
            seq = sorted(live)[pick % len(live)]
            if op == "free":
                m.free(seq)
                del live[seq]
            elif m.can_append(seq):
                m.append_token(seq, 1)
                live[seq] += 1
        m.check_invariants()
        runs = [range(m.block_table(s)[0], m.block_table(s)[0] + -(-m.reserved_tokens(s) // 2)) for s in live]
        owned = [b for r in runs for b in r]
        assert len(owned) == len(set(owned)), "two reservations overlap"
        assert all(m.num_tokens(s) == t for s, t in live.items())
        assert sum(m.held_blocks(s) for s in live) == m.num_used_blocks
    for s in list(live):
        m.free(s)
    assert m.num_free_blocks == 13 and m.metrics().num_sequences == 0
