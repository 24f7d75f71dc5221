"""The scheduler's admission in a fast-forwarded step, without the allocation it makes to be refused.

A step's admission (``Scheduler._admit``) takes queued requests until one does not fit; that last
``allocate`` call reads and checks the whole prompt (a preempted sequence's prompt and output, often
hundreds of tokens) only to raise. Without a prefix cache a paged block manager refuses a prompt exactly
when its blocks (``ceil(tokens / block_size)``) and the watermark exceed the free blocks
(``BlockManager.can_allocate``), so which queued sequence it refuses is known in advance, the earlier
ones taking their blocks. :func:`admit` hides that sequence and those after it from the scheduler's own
``_admit``, puts them back, and counts the refused call the scheduler would have made
(``record_refused_allocations``) when its loop would have reached it: the same admissions, chunks,
budget, queue and statistics.
"""

from __future__ import annotations

from pagedbench.refengine import BlockManager


def admit(sched, chunks: list, budget: int) -> int:
    """``sched._admit(chunks, copies, budget)``: its admissions, with the refused allocation counted rather
    than made (a paged block manager without a prefix cache; anything else is the scheduler's own call).
    Only a swapped-in sequence's append can plan a copy there, and the fast-forward serves recompute
    preemption only: a copy planned here is an error, not something to drop."""
    if getattr(sched, "swapped", None):
        raise ValueError("the fast-forward's admission serves recompute preemption only; this scheduler has "
                         f"{len(sched.swapped)} swapped sequences")
    copies: list = []
    cut = first_refused(sched, budget)
    if cut is None:
        return sched._admit(chunks, copies, budget)
    waiting = sched.waiting
    # the scheduler's loop sees the queue up to the refused sequence (a new list of those few: the queue
    # itself may be thousands long), and takes what it admits from its front, as from the queue's
    shown = sched.waiting = waiting[:cut]
    try:
        budget = sched._admit(chunks, copies, budget)
    finally:
        sched.waiting = waiting
        del waiting[:cut - len(shown)]
    # every sequence before it admitted: the loop would try it next
    if not shown and budget > 0 and sched.running_seats() + waiting[0].seats <= sched.max_num_seqs:
        sched.block_manager.record_refused_allocations(1)
    return budget


def first_refused(sched, budget: int) -> int | None:
    """The place in the queue of the sequence whose allocation the manager would refuse, the sequences
    before it admitted (each taking its prompt's blocks); None when the admission cannot reach one
    (the budget or the queue ends first) or is not one this module models: a prefix cache (hits change
    what a prompt takes), a manager other than the paged one, or a request of several sequences."""
    bm = sched.block_manager
    if sched.prefix_caching or not isinstance(bm, BlockManager) or bm.enable_prefix_caching:
        return None
    bs = bm.block_size
    free = bm.num_free_blocks - sched.watermark_blocks
    waiting = sched.waiting
    last = len(waiting) - 1
    for i, s in enumerate(waiting):
        if s.pending_children or (i < last and waiting[i + 1].request_id == s.request_id):
            return None
        n = len(s.token_ids)
        need = -(-n // bs)
        if need > free:
            return i
        free -= need
        budget -= n  # its prompt's chunk (nothing cached): the loop stops once the budget is spent
        if budget <= 0:
            return None
    return None
