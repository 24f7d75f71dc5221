"""Continuous batching over a block allocator: admission, chunked prefill, preemption, forks.

Each :meth:`Scheduler.schedule` call plans one step under two limits, ``max_num_seqs`` running
sequences and ``max_num_batched_tokens`` tokens computed, in this order:

With ``policy="mixed"`` (today's vLLM, chunked prefill) one step holds, in this order:

1. *decodes*: running sequences with one token left to compute, oldest first. A sequence whose last
   sampled token has no room yet gets it now (``append_token``, which may ask for a copy-on-write
   copy). When the pool has no free block the *newest* running sequence is preempted (recompute: its
   blocks are freed and it goes back to the waiting queue, ahead of every request that never ran) and
   the append retried; a sequence may preempt itself. Preemption is all-or-nothing per request (the
   paper's §4.5): every running sequence of the victim's request (its ``n`` samples, its beams) goes.
2. *prefill chunks* of running sequences still computing their prompt, oldest first, each as many
   tokens as the budget leaves.
3. *admission*: waiting sequences in priority order (FCFS; a preempted one is older than any new one,
   so preempted sequences resume first, in arrival order) while the allocator can hold them, seats and
   budget remain; the head of the queue blocks the rest. A request's waiting sequences are admitted
   together or not at all, unless, recomputed apart (recompute cannot share their blocks again), they
   could never fit the pool together: then one by one. The allocator counts prefix-cache hits (only
   the blocks a prompt must take are needed) and keeps ``watermark_blocks`` free for running sequences.

With ``policy="separate"`` (vLLM v0.1, the paper's system) a step is either prompts or decodes: prefill
chunks of running sequences and admissions first, and only when there are none, every decode.

"Oldest" is :attr:`Sequence.priority`, ``(request_id, child_index)``. With prefix caching, prompts are
allocated with ``publish=False`` and their full blocks published (:meth:`update`) only once their K/V
is computed, so no request can hit a block whose K/V is not written yet (vLLM #7822). The block manager
never reports a whole prompt cached, so the last prompt token is always computed for its logits.

After the step, :meth:`update` records it and :meth:`roll_back` undoes a failed one
(``engine/step_update.py``, a mixin of :class:`Scheduler`).
"""

from __future__ import annotations

import inspect
import operator

from pagedbench.refengine.engine import priority_order
from pagedbench.refengine.engine.prefix_offload_steps import PrefixOffloadSteps
from pagedbench.refengine.engine.schedule_plan import BlockCopy, ScheduledChunk, SchedulerOutput, StopRule
from pagedbench.refengine.engine.sequence import Sequence, SequenceStatus
from pagedbench.refengine.engine.step_update import StepUpdate
from pagedbench.refengine.engine.swap_preemption import PREEMPTION_MODES, SwapPreemption
from pagedbench.refengine.errors import InvalidArgumentError, OutOfBlocksError
from pagedbench.refengine.kv.prefix_hash import MAX_TOKEN_ID

_PENDING_CHILDREN = operator.attrgetter("pending_children")

__all__ = ["BlockCopy", "ScheduledChunk", "Scheduler", "SchedulerOutput", "StopRule"]


class Scheduler(StepUpdate, SwapPreemption, PrefixOffloadSteps):
    """Plans steps over ``block_manager`` (a BlockManager or a ContiguousBlockManager).

    A sequence forks its ``pending_children`` when its prefill completes; the engine gives children to
    fork only with an allocator that can fork (paged), otherwise it queues every child on its own.

    ``preemption_mode="swap"`` (a paged manager and a ``host_allocator``, a HostBlockAllocator): victims
    are swapped to the host pool rather than recomputed (``engine/swap_preemption.py``).
    """

    POLICIES = ("mixed", "separate")

    def __init__(self, block_manager, *, max_num_seqs: int, max_num_batched_tokens: int, stop: StopRule,
                 prefix_caching: bool, policy: str = "mixed", watermark_blocks: int = 0,
                 preemption_mode: str = "recompute", host_allocator=None) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise InvalidArgumentError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if preemption_mode == "swap" and (host_allocator is None or not hasattr(block_manager, "swap_out")):
            raise InvalidArgumentError("preemption_mode='swap' needs a host_allocator and a block manager that "
                                       f"swaps (paged); got {host_allocator!r} and {type(block_manager).__name__}")
        if policy not in self.POLICIES:
            raise InvalidArgumentError(f"policy must be one of {self.POLICIES}, got {policy!r}")
        if type(watermark_blocks) is not int or watermark_blocks < 0:
            raise InvalidArgumentError(f"watermark_blocks must be an int >= 0, got {watermark_blocks!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop = stop
        self.prefix_caching = prefix_caching  # allocate with publish=False, publish as computed
        self.policy = policy
        self.watermark_blocks = watermark_blocks
        # Orca's Pow2 and Oracle reservations size themselves by the request's output length
        self._wants_output_len = bool(getattr(block_manager, "reserves_by_output_len", False))
        # a paged manager reads a prompt whole on each allocate unless told its ids were read already
        # (see _allocate)
        try:
            self._vouches = "check_tokens" in inspect.signature(block_manager.allocate).parameters
        except (TypeError, ValueError):  # (no signature to read: it is told nothing)
            self._vouches = False
        self.waiting: list[Sequence] = []  # sorted by priority
        self.running: list[Sequence] = []  # sorted by priority
        self.num_preemptions = 0
        self.num_rollbacks = 0  # failed steps undone by roll_back
        self.peak_running = 0
        # the step being planned or run, kept for roll_back: its chunks (the list schedule() fills, so a
        # plan that fails half way is known too) and the forks update() made
        self._plan: list[ScheduledChunk] = []
        self._forks: list[tuple[Sequence, list[Sequence]]] = []
        self._forking = False  # whether a sequence with children to fork was ever queued (see running_seats)
        self._init_swap(preemption_mode, host_allocator)
        # the prefix cache's host tier: the manager plans its copies, the step carries them
        # (engine/prefix_offload_steps.py)
        self.offloading = getattr(block_manager, "host_tier", None) is not None

    # --- queue ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if seq.pending_children:
            self._forking = True
        priority_order.insort(self.waiting, seq)

    def running_seats(self) -> int:
        """The seats (:attr:`Sequence.seats`) the running sequences take: each itself and the children it
        will fork. Children to fork come only with a sequence queued here, so until one is, every running
        sequence takes one (the sum over them, read every step a request waits, is skipped)."""
        running = self.running
        if not self._forking:
            return len(running)
        return len(running) + sum(map(len, map(_PENDING_CHILDREN, running)))  # (at C speed)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort_all(self) -> None:
        """Drop every sequence: running ones give their blocks back; each ends with ``"abort"``."""
        if self.offloading:  # (a step that failed outside the engine loop, as beam search's: its copies)
            self.block_manager.undo_offload_step()
        for seq in (*self.running, *self.waiting, *(s for g in self.swapped for s in g.seqs)):
            self._end(seq)
        self._release_host_blocks()  # (between steps: the last one's swap-ins have run)
        self.running.clear()
        self.waiting.clear()

    def abort(self, request_id: int) -> list[Sequence]:
        """Drop every sequence of ``request_id`` (waiting, preempted, running, mid-prefill), freeing
        their blocks now; each ends with ``"abort"``. Returns them (empty: none was queued)."""
        mine = [s for s in (*self.running, *self.waiting, *(s for g in self.swapped for s in g.seqs))
                if s.request_id == request_id]
        if mine:
            self.running[:] = [s for s in self.running if s.request_id != request_id]
            self.waiting[:] = [s for s in self.waiting if s.request_id != request_id]
        for seq in mine:
            self._end(seq)
        return mine

    def _end(self, seq: Sequence) -> None:
        """Abort one queued or running sequence and the children it has not forked yet."""
        if self.block_manager.has_sequence(seq.seq_id):
            self.block_manager.free(seq.seq_id)
        elif self.swapped:
            self._drop_swapped(seq)
        for s in (seq, *seq.pending_children):
            s.status = SequenceStatus.FINISHED
            s.finish_reason = "abort"
        seq.pending_children = []

    # --- planning ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        self._plan = chunks
        if self._forks:
            self._forks = []
        if self.preemption_mode == "swap":
            self._release_host_blocks()  # the last step's swap-ins have read them
            self._new_swap_step()
        if self.offloading:
            self.block_manager.commit_offload_step()  # (the last step's, if update did not: an idle step)
        copies: list[BlockCopy] = []
        preempted: list[int] = []
        budget = self.max_num_batched_tokens
        if self.policy == "separate":
            budget = self._prefill_chunks(chunks, budget)
            budget = self._admit(chunks, copies, budget)
            if not chunks and not self._swap_in:
                budget, _ = self._decodes(chunks, copies, preempted, budget)
        else:
            budget, prefills_seen = self._decodes(chunks, copies, preempted, budget)
            if prefills_seen:  # else a pass over every running sequence would find nothing
                budget = self._prefill_chunks(chunks, budget)
            budget = self._admit(chunks, copies, budget)
        if not chunks and not self._swap_in and self.has_unfinished():
            raise RuntimeError(
                f"scheduler made no progress: {len(self.waiting)} waiting, {len(self.running)} running, "
                f"{self.block_manager.num_free_blocks} free blocks (a request larger than the pool?)")
        self.peak_running = max(self.peak_running, len(self.running))
        if self.offloading:
            return self._output_with_offload(chunks, copies, preempted, self.max_num_batched_tokens - budget)
        return SchedulerOutput(tuple(chunks), tuple(copies), tuple(preempted),
                               self.max_num_batched_tokens - budget, tuple(self._swap_out), tuple(self._swap_in))

    def _decodes(self, chunks: list[ScheduledChunk], copies: list[BlockCopy], preempted: list[int],
                 budget: int) -> tuple[int, bool]:
        """Plan the decodes; returns the budget left and whether a running sequence still has a prompt
        chunk to compute (one that ran out of budget leaves none for those anyway)."""
        # the loop runs once per running sequence per step: Sequence's properties are read inline here
        running = self.running
        append = self.block_manager.append_token
        i = 0
        skipped = 0  # running sequences with more than one token to compute (a prefill chunk to plan)
        while i < len(running) and budget > 0:  # 1. decodes
            seq = running[i]
            tokens = seq.token_ids
            n = len(tokens)
            if n - seq.num_computed_tokens != 1:
                skipped += 1
                i += 1
                continue
            if seq.num_table_tokens < n:  # the last sampled token still needs room
                try:
                    pairs = append(seq.seq_id, tokens[-1])
                except OutOfBlocksError:
                    if not self._append(seq, copies, preempted):
                        # seq's request was the newest: every sequence after it went too, and so did
                        # its siblings planned earlier in this pass
                        kept = [c for c in chunks if c.seq.status is SequenceStatus.RUNNING]
                        budget += len(chunks) - len(kept)
                        chunks[:] = kept
                        continue
                else:
                    seq.num_table_tokens += 1
                    if pairs:
                        copies.extend(BlockCopy(src, dst) for src, dst in pairs)
            chunks.append(ScheduledChunk(seq, n - 1, 1))
            budget -= 1
            i += 1
        return budget, skipped > 0

    def _prefill_chunks(self, chunks: list[ScheduledChunk], budget: int) -> int:
        for seq in self.running:
            if budget == 0:
                break
            left = len(seq.token_ids) - seq.num_computed_tokens  # inline: read for every running sequence
            if left > 1:
                n = min(left, budget)
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
        return budget

    def _append(self, seq: Sequence, copies: list[BlockCopy], preempted: list[int]) -> bool:
        """Room for seq's last token, preempting the newest running sequences as needed.

        Returns False when ``seq`` itself had to be preempted.
        """
        while True:
            try:
                pairs = self.block_manager.append_token(seq.seq_id, seq.token_ids[-1])
            except OutOfBlocksError:
                group = self._newest_group()
                content: dict[int, int] = {}  # a dropped copy's destination -> the block it copies
                if copies:  # a victim's copy-on-write made earlier in this pass is into a block it now frees
                    doomed = {b for victim in group for b in self.block_manager.block_table(victim.seq_id)}
                    content = {c.dst: c.src for c in copies if c.dst in doomed}
                    copies[:] = [c for c in copies if c.dst not in doomed]
                if not (self.preemption_mode == "swap" and self._swap_out_group(group, content)):
                    for victim in group:
                        self._preempt(victim)
                preempted.extend(victim.seq_id for victim in group)
                if seq in group:
                    return False
                continue
            seq.num_table_tokens += 1
            if pairs:
                copies.extend(BlockCopy(src, dst) for src, dst in pairs)
            return True

    def _newest_group(self) -> list[Sequence]:
        """The running sequences of the newest running request (the tail of ``running``)."""
        running = self.running
        rid = running[-1].request_id
        i = len(running) - 1
        while i > 0 and running[i - 1].request_id == rid:
            i -= 1
        return running[i:]

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_table_tokens = seq.num_admitted_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _admit(self, chunks: list[ScheduledChunk], copies: list[BlockCopy], budget: int) -> int:
        if not self.waiting and not self.swapped:
            return budget
        seats = self.running_seats()
        if self.swapped:  # swapped groups come back first, and the head one still out blocks the rest
            budget, seats, blocked = self._swap_in_groups(chunks, copies, budget, seats)
            if blocked:
                return budget
        waiting = self.waiting
        while waiting and budget > 0:
            rid = waiting[0].request_id
            size = 1
            while size < len(waiting) and waiting[size].request_id == rid:
                size += 1
            group = waiting[:size]  # a request's waiting sequences (several after a group preemption)
            if size > 1 and not self._fits_together(group):
                group, size = group[:1], 1  # recomputed apart, they could never run together: one by one
            if seats + sum(s.seats for s in group) > self.max_num_seqs:
                break
            taken: list[Sequence] = []
            try:  # a refused allocation changes nothing; a refused group gives back what it took
                for seq in group:
                    cached = self._allocate(seq)
                    taken.append(seq)
                    seq.num_computed_tokens = cached
            except OutOfBlocksError:
                for seq in taken:
                    self.block_manager.free(seq.seq_id)
                    seq.num_computed_tokens = 0
                break
            del waiting[:size]
            for seq in group:
                seats += seq.seats
                seq.status = SequenceStatus.RUNNING
                seq.num_table_tokens = seq.num_admitted_tokens = seq.num_tokens
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = seq.num_computed_tokens
                priority_order.insort(self.running, seq)
                n = min(seq.num_uncomputed_tokens, budget)
                if n > 0:  # a group's later members may wait for the next step's prefill chunks
                    chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                    budget -= n
        return budget

    def _fits_together(self, group: list[Sequence]) -> bool:
        """Whether ``group``, each member holding its own blocks, fits the whole pool (a recomputed group
        shares no blocks)."""
        bm = self.block_manager
        footprint = getattr(bm, "footprint_blocks", None)
        if footprint is None:
            need = sum(-(-s.num_tokens // bm.block_size) for s in group)
        else:
            need = sum(footprint(s.num_tokens, output_len=s.params.max_tokens - s.num_output_tokens)
                       for s in group)
        return need + self.watermark_blocks <= bm.num_blocks

    def _allocate(self, seq: Sequence) -> int:
        kwargs = {}
        if self.prefix_caching:
            kwargs = {"publish": False, "cache_salt": seq.cache_salt}
        if self.watermark_blocks:
            kwargs["reserve_free_blocks"] = self.watermark_blocks
        if self._wants_output_len:
            kwargs["output_len"] = seq.params.max_tokens - seq.num_output_tokens
        if self._vouches and (seq.prompt_checked or seq.num_preemptions):
            # Its ids were read before: its prompt where it entered the engine, or (it held blocks before:
            # preempted, or its step rolled back) by this manager, which accepted each of its tokens then
            # (in allocate or append_token) but perhaps the last, sampled after, which is read here. A
            # prompt is then read once, not on each admission (with a preempted sequence's output).
            last = seq.token_ids[-1]
            if type(last) is int and 0 <= last < MAX_TOKEN_ID:
                kwargs["check_tokens"] = False
        return self.block_manager.allocate(seq.seq_id, seq.token_ids, **kwargs)
