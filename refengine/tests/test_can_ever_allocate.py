"""``can_ever_allocate``: whether a sequence fits the whole pool, whatever the pool holds now (the rule
by which the engine refuses a request at once rather than queueing it), on both allocators."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedbench.refengine import BlockManager
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.kv.contiguous import ContiguousBlockManager


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 400 + 1 for i in range(n)]


def test_boundaries():
    bm = BlockManager(num_blocks=20, block_size=4)
    assert bm.can_ever_allocate(0) and bm.can_ever_allocate(80) and not bm.can_ever_allocate(81)
    assert bm.can_ever_allocate(72, reserve_free_blocks=2) and not bm.can_ever_allocate(73, reserve_free_blocks=2)
    assert bm.can_ever_allocate(0, reserve_free_blocks=20) and not bm.can_ever_allocate(1, reserve_free_blocks=20)


@settings(max_examples=60, deadline=None)
@given(held=st.lists(st.integers(1, 40), max_size=8), need=st.integers(0, 80),
       watermark=st.integers(0, 3), caching=st.booleans())
def test_can_ever_allocate_depends_on_the_pool_not_its_state(held, need, watermark, caching):
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=caching)
    for i, n in enumerate(held):
        if bm.can_allocate(n):
            bm.allocate(i, prompt(n, start=10 * i))
    before = bm.metrics()
    fits = bm.can_ever_allocate(need, reserve_free_blocks=watermark)
    assert fits == (-(-need // 4) + watermark <= 20)
    assert bm.metrics() == before  # a question changes nothing
    if fits:  # whatever the state, freeing everything admits it
        for i in range(len(held)):
            if bm.has_sequence(i):
                bm.free(i)
        assert bm.can_allocate(need, reserve_free_blocks=watermark)


def test_can_ever_allocate_refuses_bad_arguments():
    bm = BlockManager(num_blocks=4, block_size=4)
    for bad in (-1, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="num_tokens must be an int >= 0"):
            bm.can_ever_allocate(bad)
    with pytest.raises(InvalidArgumentError, match="reserve_free_blocks must be an int >= 0"):
        bm.can_ever_allocate(4, reserve_free_blocks=-1)


def test_contiguous_can_ever_allocate_is_bounded_by_the_largest_buddy_tree():
    # 12 blocks = trees of 8 and 4: a 5..8-block reservation fits only the empty 8-tree, 9 never
    cm = ContiguousBlockManager(12, 4, max_seq_len=64, policy="max")
    assert cm.can_ever_allocate(1, reserve_tokens=32) and not cm.can_ever_allocate(1, reserve_tokens=33)
    cm.allocate("a", [1], reserve_tokens=20)  # 5 blocks take the 8-tree: 8 blocks no longer fit ...
    assert not cm.can_allocate(1, reserve_tokens=32)
    assert cm.can_ever_allocate(1, reserve_tokens=32)  # ... but they will once it leaves
    first_fit = ContiguousBlockManager(12, 4, max_seq_len=64, policy="max", placement="first_fit")
    assert first_fit.can_ever_allocate(1, reserve_tokens=48) and not first_fit.can_ever_allocate(49)


