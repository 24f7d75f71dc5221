"""The scheduler's queue insertion keeps the order ``bisect.insort`` by priority keeps."""

from __future__ import annotations

import bisect
import random

from pagedbench.refengine import SamplingParams
from pagedbench.refengine.engine import priority_order
from pagedbench.refengine.engine.sequence import Sequence


def _seq(rid: int, child: int) -> Sequence:
    return Sequence(rid * 10 + child, rid, child, [0], 1, SamplingParams(max_tokens=1), None)


def test_insort_keeps_bisect_insorts_order():
    rng = random.Random(0)
    for _ in range(200):
        queue, reference = [], []
        for _ in range(rng.randrange(1, 30)):  # mostly the newest, sometimes older, sometimes a twin
            rid = rng.choice([len(queue) + 5, rng.randrange(len(queue) + 6)])
            seq = _seq(rid, rng.randrange(3))
            priority_order.insort(queue, seq)
            bisect.insort(reference, seq, key=lambda s: s.priority)
            assert queue == reference  # the same objects in the same places (an equal one goes after)


def test_insort_appends_the_newest_and_places_an_older_one():
    a, b, c = _seq(1, 0), _seq(2, 0), _seq(2, 1)
    queue = [a, c]
    priority_order.insort(queue, b)
    assert queue == [a, b, c]
    priority_order.insort(queue, _seq(9, 0))
    assert [s.request_id for s in queue] == [1, 2, 2, 9]
