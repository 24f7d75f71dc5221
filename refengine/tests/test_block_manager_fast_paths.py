"""The block manager's fast paths behave as the plain ones: ``append_token_rounds`` leaves the state one
``append_token`` call per sequence per round leaves (the same block ids in every table, the same free
order and so the same future takes, the same prefix cache and statistics; a refused call changes
nothing), and a prompt of plain ints is taken as a copy, like any other."""

from __future__ import annotations

import random

import pytest
from pagedbench.refengine import BlockManager
from pagedbench.refengine.errors import InvalidArgumentError, OutOfBlocksError, UnknownSequenceError


def _state(bm: BlockManager, ids) -> tuple:
    bm.check_invariants()
    return ([bm.block_table(s) for s in ids], [bm.token_ids(s) for s in ids], bm.free_block_ids(),
            bm.metrics())


def _pair(seed: int, prefix: bool, publish: bool) -> tuple[BlockManager, BlockManager, list[int]]:
    """Two managers brought to one state: sequences of random lengths (a few sharing prompts, forks,
    some freed so that free and cached blocks interleave)."""
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
    for bm in pair:
        bm.fork(parent, 100)
    ids.append(100)
    rng.shuffle(ids)
    return *pair, ids


@pytest.mark.parametrize("prefix,publish", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("seed", range(4))
def test_rounds_equal_one_call_per_token(seed, prefix, publish):
    one, rounds, ids = _pair(seed, prefix, publish)
    k = random.Random(seed).randrange(1, 40)
    for _ in range(k):
        for s in ids:
            one.append_token(s, 7)
    rounds.append_token_rounds(ids, 7, k)
    assert _state(rounds, ids) == _state(one, ids)
    for bm in (one, rounds):  # and later takes (evictions included) come out alike
        bm.allocate(999, list(range(3 * bm.block_size)))
    assert _state(rounds, [*ids, 999]) == _state(one, [*ids, 999])


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
