"""The free queue's batches leave what their one-at-a-time calls leave: ``popleft_many(n)`` is ``n``
calls of ``popleft`` (blocks handed out with ref count 1, links cleared), ``extend`` one ``append`` per
block; a refused batch changes nothing."""

from __future__ import annotations

import random

import pytest
from pagedbench.refengine.kv.free_block_queue import FreeBlockQueue, KVBlock


def _queue(ids) -> tuple[FreeBlockQueue, list[KVBlock]]:
    blocks = [KVBlock(i) for i in ids]
    return FreeBlockQueue(blocks), blocks


def _links(blocks) -> list[tuple]:
    return [(b.block_id, b.ref_count, b.in_free_queue, b.prev_free is None, b.next_free is None) for b in blocks]


@pytest.mark.parametrize("seed", range(6))
def test_popleft_many_is_popleft_n_times(seed):
    rng = random.Random(seed)
    ids = rng.sample(range(100), rng.randrange(1, 30))
    one, _ = _queue(ids)
    many, _ = _queue(ids)
    while len(one):
        n = rng.randrange(0, len(one) + 1)
        expected = [one.popleft() for _ in range(n)]
        for b in expected:
            b.ref_count = 1
        got = many.popleft_many(n)
        assert [b.block_id for b in got] == [b.block_id for b in expected]
        assert _links(got) == _links(expected)
        assert len(many) == len(one) and many.block_ids() == one.block_ids()
        many.check("many")
    assert many.popleft_many(0) == [] and len(many) == 0
    many.check("empty")


def test_popleft_many_past_the_length_takes_none():
    q, blocks = _queue(range(3))
    with pytest.raises(IndexError, match=r"popleft_many\(4\) from a FreeBlockQueue of 3"):
        q.popleft_many(4)
    assert q.block_ids() == [0, 1, 2] and all(b.in_free_queue and b.ref_count == 0 for b in blocks)
    q.check("q")


@pytest.mark.parametrize("seed", range(4))
def test_extend_is_append_in_order(seed):
    rng = random.Random(seed)
    one, _ = _queue(range(5))
    many, _ = _queue(range(5))
    for lap in range(4):
        ids = rng.sample(range(100 * (lap + 1), 100 * (lap + 2)), rng.randrange(0, 8))
        for b in [KVBlock(i) for i in ids]:
            one.append(b)
        many.extend([KVBlock(i) for i in ids])
        assert many.block_ids() == one.block_ids() and len(many) == len(one)
        many.check("many")
        taken = many.popleft_many(2)  # the links of the ends stay usable
        assert [b.block_id for b in taken] == [one.popleft().block_id, one.popleft().block_id]


def test_extend_with_a_queued_block_appends_none():
    q, blocks = _queue(range(3))
    fresh = KVBlock(7)
    with pytest.raises(AssertionError, match="block 1 appended to a free queue twice"):
        q.extend([fresh, blocks[1]])
    assert q.block_ids() == [0, 1, 2] and not fresh.in_free_queue and fresh.next_free is None
    q.check("q")
