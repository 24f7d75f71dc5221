"""The block manager's fast paths behave as the plain ones: ``append_token_rounds`` leaves the state one
``append_token`` call per sequence per round leaves (the same block ids in every table, the same free
order and so the same future takes, the same prefix cache and statistics; a refused call changes
nothing), and a prompt of plain ints is taken as a copy, like any other."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from pagedbench.refengine import BlockManager
from pagedbench.refengine.errors import InvalidArgumentError, OutOfBlocksError, UnknownSequenceError
from pagedbench.refengine.kv import token_checks


def _state(bm: BlockManager, ids) -> tuple:
    bm.check_invariants()
    return ([bm.block_table(s) for s in ids], [bm.token_ids(s) for s in ids], bm.free_block_ids(),
            bm.metrics())


def _pair(seed: int, prefix: bool, publish: bool, fork: bool = True) -> tuple[BlockManager, BlockManager, list[int]]:
    """Two managers brought to one state: sequences of random lengths (a few sharing prompts, a fork unless
    ``fork=False``, some freed so that free and cached blocks interleave)."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 16])
    pair = BlockManager(300, bs, enable_prefix_caching=prefix), BlockManager(300, bs, enable_prefix_caching=prefix)
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(1, 6 * bs))] for _ in range(4)]
    ids = []
    for s in range(12):
        prompt = list(rng.choice(prompts)) + [rng.randrange(4)] * rng.randrange(3)
        for bm in pair:
            bm.allocate(s, prompt, publish=publish)
            if prefix and not publish:
                bm.publish_blocks(s, len(prompt) - 1)
        ids.append(s)
    for s in rng.sample(ids, 3):  # freed: their blocks go back (cached ones stay in the cache)
        for bm in pair:
            bm.free(s)
        ids.remove(s)
    parent = ids[0]
    for bm in pair:  # a child whose last block is shared: only a full one lets rounds start
        while bm.num_tokens(parent) % bs:
            bm.append_token(parent, 1)
    if fork:
        for bm in pair:
            bm.fork(parent, 100)
        ids.append(100)
    rng.shuffle(ids)
    return *pair, ids


def _one_by_one(bm: BlockManager, ids, token_id: int, num_rounds: int, publish_full_blocks: bool) -> None:
    """What ``append_token_rounds`` stands for, call by call."""
    for _ in range(num_rounds):
        for s in ids:
            bm.append_token(s, token_id)
        if publish_full_blocks:
            for s in ids:
                if bm.num_tokens(s) % bm.block_size == 0:
                    bm.publish_blocks(s, bm.num_tokens(s))


def _most_rounds(bm: BlockManager, ids, limit: int) -> int:
    """The most rounds (<= limit) whose takes the free blocks cover (0 when round 0's do not fit)."""
    bs = bm.block_size
    need = lambda k: sum(len(range(-bm.num_tokens(s) % bs, k, bs)) for s in ids)  # noqa: E731
    return max(k for k in range(limit + 1) if need(k) <= bm.num_free_blocks)


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "evicting"])
@pytest.mark.parametrize("full", [False, True], ids=["appends", "publishing"])
@pytest.mark.parametrize("prefix,publish", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("seed", range(4))
def test_rounds_equal_one_call_per_token(seed, prefix, publish, full, tight):
    one, rounds, ids = _pair(seed, prefix, publish)
    if tight:
        for bm in (one, rounds):
            _crowd(bm, seed, publish)
    k = _most_rounds(one, ids, random.Random(seed).randrange(1, 60))
    _one_by_one(one, ids, 7, k, full)
    rounds.append_token_rounds(ids, 7, k, publish_full_blocks=full)
    assert _state(rounds, ids) == _state(one, ids)
    for bm in (one, rounds):  # and later takes (evictions included) come out alike
        bm.free(ids[0])
        bm.allocate(999, list(range(2 * bm.block_size)))
    assert _state(rounds, [*ids[1:], 999]) == _state(one, [*ids[1:], 999])


def _crowd(bm: BlockManager, seed: int, publish: bool) -> list[list[int]]:
    """Cached blocks (sequences published and freed), then a sequence that leaves two uncached blocks
    free: rounds' takes evict cached ones. Returns the cached prompts."""
    rng = random.Random(seed)
    prompts = []
    for s in range(8):
        prompts.append([rng.randrange(4) for _ in range(3 * bm.block_size)])
        bm.allocate(("cached", s), prompts[-1], publish=publish)
        bm.publish_blocks(("cached", s), len(prompts[-1]))
        bm.free(("cached", s))
    bm.allocate("ballast", [9] * bm.block_size * (bm.num_free_blocks - bm.num_cached_blocks - 2), publish=False)
    return prompts


@pytest.mark.parametrize("publish", [False, True])
def test_the_evicting_cases_evict(publish):
    _, rounds, ids = _pair(1, True, publish)
    _crowd(rounds, 1, publish)
    before = rounds.metrics()
    rounds.append_token_rounds(ids, 7, _most_rounds(rounds, ids, 60), publish_full_blocks=True)
    assert rounds.metrics().evictions > before.evictions + 2


def test_rounds_take_blocks_round_by_round():
    bm = BlockManager(8, 2)
    bm.allocate("a", [1, 2])  # full: takes at rounds 0 and 2
    bm.allocate("b", [1])  # one free slot: takes at round 1
    bm.append_token_rounds(["a", "b"], 0, 3)
    assert bm.block_table("a") == [0, 2, 4] and bm.block_table("b") == [1, 3]


def test_refused_rounds_change_nothing():
    bm = BlockManager(4, 4)
    bm.allocate("a", [1] * 4)
    bm.allocate("b", [1] * 5)
    bm.fork("b", "c")
    before = _state(bm, ["a", "b", "c"])
    # a takes a block on rounds 0 and 4: two, with one free (the first four rounds would fit)
    with pytest.raises(OutOfBlocksError, match="5 rounds of appends to 1 sequences need 2 new blocks but only 1"):
        bm.append_token_rounds(["a"], 0, 5)
    with pytest.raises(InvalidArgumentError, match="seq_ids must be distinct"):
        bm.append_token_rounds(["a", "a"], 0, 1)
    with pytest.raises(UnknownSequenceError, match="unknown sequence 'd'"):
        bm.append_token_rounds(["a", "d"], 0, 1)
    with pytest.raises(InvalidArgumentError, match="num_rounds must be an int >= 0, got -1"):
        bm.append_token_rounds(["a"], 0, -1)
    with pytest.raises(InvalidArgumentError, match="token id must be"):
        bm.append_token_rounds(["a"], -3, 1)
    with pytest.raises(InvalidArgumentError, match="shares its last block"):
        bm.append_token_rounds(["a", "c"], 0, 1)
    assert _state(bm, ["a", "b", "c"]) == before


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "unforked"])  # (unforked: no shared-block pass)
@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "evicting"])
@pytest.mark.parametrize("prefix,publish", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("seed", range(4))
def test_runs_equal_one_call_per_token(seed, prefix, publish, tight, fork):
    one, runs, ids = _pair(seed, prefix, publish, fork)
    if tight:
        for bm in (one, runs):
            _crowd(bm, seed, publish)
    rng = random.Random(seed)
    pairs, need, lengths = [], 0, {s: one.num_tokens(s) for s in ids}
    for _ in range(40):  # sequences coming back, counts of 0 and across several blocks, as the pool allows
        s, c = rng.choice(ids), rng.choice([0, 1, rng.randrange(1, 3 * one.block_size)])
        more = -(-(lengths[s] + c) // one.block_size) - -(-lengths[s] // one.block_size)
        if need + more <= one.num_free_blocks:
            pairs.append((s, c))
            need, lengths[s] = need + more, lengths[s] + c
    for s, c in pairs:
        for _ in range(c):
            one.append_token(s, 7)
    runs.append_token_runs([s for s, _ in pairs], [c for _, c in pairs], 7)
    assert _state(runs, ids) == _state(one, ids)


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "unforked"])
@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "evicting"])
@pytest.mark.parametrize("prefix,publish", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("seed", range(4))
def test_takes_equal_one_call_per_token(seed, prefix, publish, tight, fork):
    one, takes, ids = _pair(seed, prefix, publish, fork)
    if tight:
        for bm in (one, takes):
            _crowd(bm, seed, publish)
    rng = random.Random(seed)
    order = [rng.choice(ids) for _ in range(min(40, one.num_free_blocks - 2))]  # sequences coming back
    for s in order:  # up to and including the append that takes a block
        n = one.num_tokens(s)
        for _ in range(-n % one.block_size + 1):
            one.append_token(s, 7)
    takes.append_token_takes(order, 7)
    assert _state(takes, ids) == _state(one, ids)
    for bm in (one, takes):  # and later takes (evictions included) come out alike
        bm.free(ids[0])
        bm.allocate(999, list(range(2 * bm.block_size)))
    assert _state(takes, [*ids[1:], 999]) == _state(one, [*ids[1:], 999])


def test_takes_count_the_tokens_up_to_each_block():
    bm = BlockManager(8, 4)
    bm.allocate("a", [1] * 4)  # full: its next token takes a block
    bm.allocate("b", [1] * 2)  # two tokens fill its block, the third takes one
    bm.append_token_takes(["b", "a", "a"], 0)
    assert bm.block_table("b") == [1, 2] and bm.block_table("a") == [0, 3, 4]
    assert bm.num_tokens("b") == 5 and bm.num_tokens("a") == 9 and bm.num_live_tokens == 14
    bm.check_invariants()


def test_takes_and_runs_may_use_every_free_block():
    for call in ("takes", "runs"):
        bm = BlockManager(4, 4)
        bm.allocate("a", [1] * 4)  # three blocks free, and its next token takes one
        if call == "takes":
            bm.append_token_takes(["a", "a", "a"], 0)
        else:
            bm.append_token_runs(["a", "a"], [5, 4], 0)
        assert bm.num_free_blocks == 0 and bm.num_tokens("a") == 13
        bm.check_invariants()


def test_refused_takes_change_nothing():
    bm = BlockManager(4, 4)
    bm.allocate("a", [1] * 4)
    bm.allocate("b", [1] * 5)
    bm.fork("b", "c")
    before = _state(bm, ["a", "b", "c"])
    with pytest.raises(OutOfBlocksError, match="2 appends up to a new block need 2 new blocks but only 1"):
        bm.append_token_takes(["a", "a"], 0)
    with pytest.raises(UnknownSequenceError, match="unknown sequence 'd'"):
        bm.append_token_takes(["a", "d"], 0)
    with pytest.raises(InvalidArgumentError, match="token id must be"):
        bm.append_token_takes(["a"], -3)
    with pytest.raises(InvalidArgumentError, match="sequence 'c' shares its last block"):
        bm.append_token_takes(["a", "c"], 0)
    assert _state(bm, ["a", "b", "c"]) == before
    bm.append_token_takes([], 0)
    assert _state(bm, ["a", "b", "c"]) == before


def test_runs_take_blocks_in_the_pairs_order():
    bm = BlockManager(8, 2)
    bm.allocate("a", [1, 2])
    bm.allocate("b", [1])
    bm.append_token_runs(["b", "a", "b", "a"], [1, 1, 2, 2], 0)  # b fills; a takes 2; b takes 3; a fills 2, takes 4
    assert bm.block_table("a") == [0, 2, 4] and bm.block_table("b") == [1, 3]
    assert bm.token_ids("b") == [1, 0, 0, 0] and bm.num_live_tokens == 9


def test_runs_past_a_shared_full_block():
    """A forked table's full last block is shared, but the pairs' next token starts a block of its own: a
    sequence coming back in a later pair writes into that new block, nothing shared."""
    one, runs = BlockManager(8, 4), BlockManager(8, 4)
    for bm in (one, runs):
        bm.allocate("a", [1] * 4)
        bm.fork("a", "b")
    for s, c in [("b", 1), ("a", 2), ("b", 2)]:
        for _ in range(c):
            one.append_token(s, 0)
    runs.append_token_runs(["b", "a", "b"], [1, 2, 2], 0)
    assert _state(runs, ["a", "b"]) == _state(one, ["a", "b"])


def test_refused_runs_change_nothing():
    bm = BlockManager(4, 4)
    bm.allocate("a", [1] * 4)
    bm.allocate("b", [1] * 5)
    bm.fork("b", "c")
    before = _state(bm, ["a", "b", "c"])
    with pytest.raises(OutOfBlocksError, match="6 appends to 1 sequences need 2 new blocks but only 1"):
        bm.append_token_runs(["a", "a"], [1, 5], 0)
    with pytest.raises(InvalidArgumentError, match="one count per sequence: 1 counts for 2"):
        bm.append_token_runs(["a", "b"], [1], 0)
    with pytest.raises(InvalidArgumentError, match="counts must be ints >= 0, got -1"):
        bm.append_token_runs(["a"], [-1], 0)
    with pytest.raises(InvalidArgumentError, match="counts must be ints >= 0, got -1"):  # the bad one, not the 0
        bm.append_token_runs(["a", "b"], [0, -1], 0)
    with pytest.raises(UnknownSequenceError, match="unknown sequence 'd'"):
        bm.append_token_runs(["a", "d"], [1, 1], 0)
    with pytest.raises(InvalidArgumentError, match="token id must be"):
        bm.append_token_runs(["a"], [1], -3)
    with pytest.raises(InvalidArgumentError, match="shares its last block"):
        bm.append_token_runs(["a", "c"], [1, 1], 0)
    assert _state(bm, ["a", "b", "c"]) == before
    bm = BlockManager(4, 4)  # no fork: the tokens of pairs counted before the refusal are taken back
    bm.allocate("x", [1] * 3)
    bm.allocate("y", [1] * 6)
    before = _state(bm, ["x", "y"])
    with pytest.raises(OutOfBlocksError, match="15 appends to 2 sequences need 4 new blocks but only 1"):
        bm.append_token_runs(["y", "x", "y", "x"], [2, 1, 7, 5], 0)
    with pytest.raises(InvalidArgumentError, match="counts must be ints >= 0"):
        bm.append_token_runs(["x", "y"], [3, 1.0], 0)
    assert _state(bm, ["x", "y"]) == before


def test_a_prompt_list_is_copied():
    prompt = [1, 2, 3]
    bm = BlockManager(4, 2)
    bm.allocate("a", prompt)
    prompt.append(4)  # the caller's list grows (the scheduler appends sampled tokens to its own)
    assert bm.token_ids("a") == [1, 2, 3] and bm.num_tokens("a") == 3


@pytest.mark.parametrize("reserve", [0, 1, 3])
def test_can_allocate_says_what_allocate_does(reserve):
    bm = BlockManager(6, 4)
    bm.allocate("a", [1] * 6)  # 2 blocks: 4 free
    for n in range(1, 22):
        fits = bm.can_allocate(n, reserve_free_blocks=reserve)
        try:
            bm.allocate("b", [1] * n, reserve_free_blocks=reserve)
        except OutOfBlocksError:
            assert not fits, n
        else:
            assert fits, n
            bm.free("b")
    with pytest.raises(InvalidArgumentError, match="reserve_free_blocks must be an int >= 0, got -1"):
        bm.can_allocate(1, reserve_free_blocks=-1)


@pytest.mark.parametrize("seed", range(4))
def test_allocation_preview_says_what_allocate_does(seed):
    one, _, _ = _pair(seed, True, False)
    rng = random.Random(seed)
    known = _crowd(one, seed, False)  # a tight pool: some prompts fit only thanks to their hits
    bs = one.block_size
    for s in range(40):
        # a cached prompt's first blocks, then new tokens: as many blocks as are free, give or take two
        prompt = rng.choice(known)[:bs * rng.randrange(4)]
        prompt += [rng.randrange(4) for _ in range(rng.randrange(1, bs * (one.num_free_blocks + 3)) - len(prompt))]
        reserve = rng.choice([0, 1, 2])
        preview = one.allocation_preview(prompt, reserve_free_blocks=reserve)
        before = one.metrics()
        try:
            cached = one.allocate(("new", s), prompt, publish=False, reserve_free_blocks=reserve)
        except OutOfBlocksError:
            assert not preview.fits and one.metrics().failed_allocations == before.failed_allocations + 1
            continue
        assert preview.fits and cached == preview.num_hit_blocks * bs
        one.free(("new", s))
    with pytest.raises(InvalidArgumentError, match="reserve_free_blocks must be an int >= 0"):
        one.allocation_preview([1], reserve_free_blocks=-1)
    with pytest.raises(InvalidArgumentError, match="cache_salt"):
        one.allocation_preview([1], cache_salt=3)


def test_append_tokens_to_a_block_boundary_and_into_the_last_free_block():
    """A run of appends ending on a block boundary takes no block for the token after it, and one that needs
    exactly the free blocks gets them."""
    bm = BlockManager(4, 4)
    bm.allocate("a", [1, 2, 3])
    bm.append_tokens("a", [4, 5, 6, 7, 8])  # 8 tokens: two full blocks
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 2
    bm.append_tokens("a", [9] * 8)  # two more blocks: every free one
    assert len(bm.block_table("a")) == 4 and bm.num_free_blocks == 0 and bm.token_ids("a")[-1] == 9
    bm.check_invariants()


def test_append_tokens_refuses_a_shared_last_block_and_changes_nothing():
    """A forked child's partly filled last block is shared: appending in bulk would write into its sibling's
    block, so it is refused (append_token copies it on write first); a shared full block is no reason."""
    bm = BlockManager(8, 4)
    bm.allocate("a", [1, 2, 3, 4, 5, 6])  # one full block, one with 2 of 4 slots
    bm.fork("a", "b")
    before = _state(bm, ["a", "b"])
    with pytest.raises(InvalidArgumentError, match="shares its last block"):
        bm.append_tokens("b", [7])
    assert _state(bm, ["a", "b"]) == before
    assert bm.append_token("b", 7)  # copied on write: b's last block is its own now
    bm.append_tokens("b", [8, 9])
    assert bm.token_ids("b")[-3:] == [7, 8, 9] and bm.token_ids("a") == [1, 2, 3, 4, 5, 6]
    bm.allocate("c", [1, 2, 3, 4])  # one full block
    bm.fork("c", "d")
    bm.append_tokens("d", [5])  # its next token starts a block of its own: nothing shared is written
    assert bm.block_table("d")[0] == bm.block_table("c")[0] and len(bm.block_table("d")) == 2
    bm.check_invariants()


def test_append_tokens_refuses_a_token_id_past_the_largest():
    from pagedbench.refengine.kv.prefix_hash import MAX_TOKEN_ID

    bm = BlockManager(4, 4)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="token id"):
        bm.append_tokens("a", [5, MAX_TOKEN_ID])
    assert bm.token_ids("a") == [1, 2, 3] and bm.num_free_blocks == 3
    bm.append_tokens("a", [MAX_TOKEN_ID - 1])  # the largest there is


def test_recording_no_refused_allocation_is_allowed():
    bm = BlockManager(2, 4)
    bm.record_refused_allocations(0)
    assert bm.metrics().failed_allocations == 0


@pytest.mark.parametrize("case", ["plain", "forked", "prefix"])
def test_free_gives_blocks_back_tail_first(case):
    """Whether free takes its one-pass path (no fork made, no prefix cache) or not, a freed table's blocks
    go back tail first, after the blocks already free, and their tokens stop counting."""
    bm = BlockManager(8, 4, enable_prefix_caching=case == "prefix")
    bm.allocate("a", [1] * 10, publish=False)  # blocks 0, 1, 2
    bm.allocate("b", [2] * 5, publish=False)  # blocks 3, 4
    if case == "forked":
        bm.fork("b", "c")
    bm.free("a")
    assert bm.free_block_ids() == [5, 6, 7, 2, 1, 0] and bm.num_live_tokens == 5
    bm.free("b")
    assert bm.free_block_ids() == [5, 6, 7, 2, 1, 0] + ([] if case == "forked" else [4, 3])  # (c holds b's)
    assert bm.num_live_tokens == (5 if case == "forked" else 0)
    bm.check_invariants()


@pytest.mark.parametrize("bad", [-256, -(2**63), -(2**62), 2**63, 2**64 + 5])
def test_a_prompt_of_ints_is_checked_whole_on_the_fast_path(bad):
    """The check of a list of plain ints reads each one's sign, not one of its low bytes (-256's lowest
    byte is 0), and refuses what int64 cannot hold, naming it (a 0 beside it is a token); a refusal
    changes nothing."""
    bm = BlockManager(4, 4)
    named = f"got {bad}$" if bad < 0 else r"got one >= 2\*\*63$"
    with pytest.raises(InvalidArgumentError, match=r"token ids must be in \[0, 2\*\*63\), " + named):
        bm.allocate("a", [0, 2, bad, 3])
    assert not bm.has_sequence("a") and bm.num_free_blocks == 4
    bm.allocate("a", [0, 2**63 - 1])  # the bounds themselves are tokens
    assert bm.token_ids("a") == [0, 2**63 - 1]


class _Id(int):
    """An int subclass (an enum member, say): a token once made a plain int."""


_PROMPTS = [[0, 5, 2**31 - 1], [0, True, 3], [0, -1, 3], [-(2**31)], [2**31 - 1, 2**31], [0, 1.0], [0, _Id(7)],
            [0, np.int64(9), 4], [3] * 40 + [-2], [3] * 40 + [False], [7], [2**40, 1],
            [1.0, True], [5, 1.5, False, 6],  # (a float and a bool fill two records: the length alone passes)
            [struct.unpack("<d", b"iiiiiiii")[0]]]  # (a float whose bytes read as int codes: the codes alone pass)


@pytest.mark.parametrize("prompt", _PROMPTS, ids=range(len(_PROMPTS)))
def test_the_marshal_check_of_a_prompt_decides_as_the_general_checks(prompt, monkeypatch):
    """A list read from its marshal record (the fast path for ints below 2**31) is taken or refused as the
    general checks take or refuse it: a bool, a negative int (-1's record has its top byte set), a float,
    an int subclass or a numpy scalar is never read as a plain token there, and a large id is not refused."""
    assert token_checks.MARSHAL_CHECK  # this Python writes the layout the fast path reads

    def outcome():
        try:
            return token_checks.checked_token_list(prompt)
        except InvalidArgumentError as e:
            return str(e)

    fast = outcome()
    monkeypatch.setattr(token_checks, "MARSHAL_CHECK", False)
    general = outcome()
    assert fast == general and all(type(t) is int for t in (fast if isinstance(fast, list) else []))


_READERS = {  # each reads or changes a table whose tokens were told late, before anything writes them
    "invariants": lambda bm, s: bm.check_invariants(),
    "metrics": lambda bm, s: (bm.metrics(), bm.num_live_tokens),
    "num_tokens": lambda bm, s: bm.num_tokens(s),
    "free": lambda bm, s: (bm.free(s), bm.metrics(), bm.num_live_tokens, bm.free_block_ids()),
    "fork": lambda bm, s: (bm.fork(s, "child"), bm.token_ids("child"), bm.append_token("child", 5), bm.token_ids(s)),
    "slot": lambda bm, s: bm.slot(s, bm.num_tokens(s) - 1),
    "can_append": lambda bm, s: bm.can_append(s),
    "append_token": lambda bm, s: (bm.append_token(s, 3), bm.token_ids(s)),
    "append_tokens": lambda bm, s: (bm.append_tokens(s, [3, 4]), bm.token_ids(s)),
    "rounds": lambda bm, s: (bm.append_token_rounds([s], 3, 2), bm.token_ids(s)),
    "runs of another token": lambda bm, s: (bm.append_token_runs([s, s], [2, 1], 9), bm.token_ids(s)),
    "takes of another token": lambda bm, s: (bm.append_token_takes([s], 9), bm.token_ids(s)),
    "publish": lambda bm, s: (bm.publish_blocks(s, bm.num_tokens(s)), bm.metrics()),
}


@pytest.mark.parametrize("reader", list(_READERS))
@pytest.mark.parametrize("prefix,publish", [(False, True), (True, False)])
@pytest.mark.parametrize("seed", range(3))
def test_tokens_told_late_read_as_the_calls_one_by_one_leave_them(seed, prefix, publish, reader):
    """Takes and runs keep a table's tokens as a count until something else reads the table: every reader
    (and every later writer) sees what the one-by-one appends leave, and a refused run gives the count back."""
    one, late, ids = _pair(seed, prefix, publish, fork=False)
    rng = random.Random(seed)
    order = [rng.choice(ids) for _ in range(min(12, one.num_free_blocks // 3))]
    for s in order:
        for _ in range(-one.num_tokens(s) % one.block_size + 1):
            one.append_token(s, 7)
    late.append_token_takes(order, 7)
    pairs = [(rng.choice(ids), rng.randrange(0, one.block_size)) for _ in range(6)]
    for s, c in pairs:
        for _ in range(c):
            one.append_token(s, 7)
    late.append_token_runs([s for s, _ in pairs], [c for _, c in pairs], 7)
    with pytest.raises(OutOfBlocksError):  # refused: the counts it added are given back
        late.append_token_runs([ids[0], ids[1]], [1, 10**6], 7)
    s = order[-1]
    assert _READERS[reader](late, s) == _READERS[reader](one, s)
    live = [i for i in ids if one.has_sequence(i)]
    assert _state(late, live) == _state(one, live)
