"""The free queue's batches leave what their one-at-a-time calls leave: ``popleft_many(n)`` is ``n``
calls of ``popleft`` (blocks handed out with ref count 1, links cleared), ``extend`` one ``append`` per
block; a refused batch changes nothing."""

from __future__ import annotations

import random

import pytest
from pagedbench.refengine.kv.free_block_queue import FifoBlockQueue, FreeBlockQueue, KVBlock


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


@pytest.mark.parametrize("seed", range(8))
def test_the_list_backed_fifo_keeps_the_linked_queues_order(seed):
    """The uncached blocks' queue (a list read from a moving head) hands out and takes back blocks in the
    order the linked queue does, through its compaction too, with the same ref counts and marks."""
    rng = random.Random(seed)
    FifoBlockQueue._COMPACT = 4  # (compact often here)
    try:
        linked, fifo = FreeBlockQueue([KVBlock(i) for i in range(20)]), FifoBlockQueue([KVBlock(i) for i in range(20)])
        held_l, held_f = [], []
        for _ in range(200):
            if held_l and rng.random() < 0.5:
                k = rng.randrange(1, len(held_l) + 1)
                back_l, back_f = held_l[:k], held_f[:k]
                del held_l[:k], held_f[:k]
                linked.extend(back_l, release=True)
                fifo.extend(back_f, release=True)
            else:
                n = rng.randrange(0, len(linked) + 1)
                got_l, got_f = linked.popleft_many(n), fifo.popleft_many(n)
                assert [(b.block_id, b.ref_count, b.in_free_queue) for b in got_f] == \
                       [(b.block_id, b.ref_count, b.in_free_queue) for b in got_l]
                held_l += got_l
                held_f += got_f
            assert fifo.block_ids() == linked.block_ids() and len(fifo) == len(linked)
            fifo.check("fifo")
        if len(linked):
            assert fifo.peekleft().block_id == linked.peekleft().block_id
            assert fifo.popleft().block_id == linked.popleft().block_id
    finally:
        FifoBlockQueue._COMPACT = 1024


def test_the_fifo_refuses_what_the_linked_queue_refuses():
    q = FifoBlockQueue([KVBlock(i) for i in range(3)])
    with pytest.raises(IndexError, match=r"popleft_many\(4\) from a FifoBlockQueue of 3"):
        q.popleft_many(4)
    (b,) = q.popleft_many(1)
    fresh = KVBlock(7)
    with pytest.raises(AssertionError, match="block 2 appended to a free queue twice"):
        q.extend([fresh, list(q)[1]])
    assert q.block_ids() == [1, 2] and not fresh.in_free_queue
    q.check("q")
    b.ref_count = 0
    b.in_free_queue = True
    q._items.append(b)  # corrupt: queued behind the count's back
    with pytest.raises(AssertionError, match="length 2 but 3 blocks queued"):
        q.check("q")
    with pytest.raises(IndexError, match="empty FifoBlockQueue"):
        FifoBlockQueue().popleft()
