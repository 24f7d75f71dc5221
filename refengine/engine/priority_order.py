"""The scheduler's queues kept in :attr:`~pagedbench.refengine.engine.sequence.Sequence.priority` order.

A queue takes sequences one at a time, most often the newest of all (a request that just arrived, one
just admitted): :func:`insort` appends it then, puts it first when it is the oldest (a sequence
preempted, most often older than every waiting one), and otherwise finds its place as ``bisect.insort`` with
the priority as key does (after any equal one), reading the key at C speed rather than through the
property.
"""

from __future__ import annotations

import bisect
import operator

_PRIORITY = operator.attrgetter("request_id", "child_index")  # Sequence.priority, at C speed


def insort(queue: list, seq) -> None:
    """``bisect.insort(queue, seq, key=lambda s: s.priority)`` (``queue`` sorted by it)."""
    if not queue or queue[-1].request_id < seq.request_id:  # a newer request than any: one int compared
        queue.append(seq)
        return
    key = _PRIORITY(seq)
    if _PRIORITY(queue[-1]) <= key:
        queue.append(seq)
    elif key < _PRIORITY(queue[0]):  # the oldest of all: a preempted sequence goes back to the front
        queue.insert(0, seq)
    else:
        bisect.insort(queue, seq, key=_PRIORITY)
