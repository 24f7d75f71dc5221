"""Swap preemption (the vLLM paper's §4.5, vLLM v0's ``preemption_mode="swap"``): a victim group's
blocks go to a host pool instead of being dropped, and come back before any new admission.

*Swap-out* (planning, when a decode needs a block and the newest running group must go): the group's
distinct device blocks (a block its samples share is copied once) get host blocks, the pairs go into
the step's ``swap_out`` list, and the device tables are freed (published blocks stay cached, evictable).
The sequences keep their computed counts and wait in ``swapped`` (priority order). When the host pool
cannot take the group it is recompute-preempted instead (``num_swap_fallbacks``).

*Swap-in* (the start of admission, before any waiting sequence): the oldest swapped group, when the
device has room for its blocks, one more per sequence whose last token needs room, and the watermark,
gets fresh device blocks in the same sharing (pairs in ``swap_in``), runs again, and appends its last
token at once (a copy-on-write it causes reads a swapped-in block: the executor applies swap-ins before
the copies). While the head group cannot come back, nothing new is admitted; a group that could not
fit even with nothing running goes to recompute instead. A group swapped out in a step is not swapped
in in the same step. Host blocks a swap-in read are released once the executor has copied them (in
``update``, or at the next planning or abort): a swap-out planned later in the same step must not be
given them, as the executor applies every swap-out before any swap-in.

A failed step (see ``step_update.roll_back``): groups swapped out in it (their host copy may not have
run) and sequences swapped in in it (their device copy may not have run) are recompute-preempted, and
their host blocks released.

A mixin of :class:`~pagedbench.refengine.engine.scheduler.Scheduler`.
"""

from __future__ import annotations

from pagedbench.refengine.engine import priority_order
from pagedbench.refengine.engine.schedule_plan import BlockCopy, BlockSwap, ScheduledChunk
from pagedbench.refengine.engine.sequence import Sequence, SequenceStatus

PREEMPTION_MODES = ("recompute", "swap")


class SwappedGroup:
    """A request's sequences swapped out together, and the host blocks holding their KV."""

    __slots__ = ("host_ids", "seqs", "tables")

    def __init__(self, seqs: list[Sequence], tables, host_ids: list[int]) -> None:
        self.seqs = seqs  # priority order
        self.tables = tables  # the block manager's SwappedTables
        self.host_ids = host_ids  # host_ids[i] holds tables.block_ids[i]'s KV

    @property
    def priority(self) -> tuple[int, int]:
        return self.seqs[0].priority

    @property
    def request_id(self) -> int:  # (priority_order reads these two)
        return self.seqs[0].request_id

    @property
    def child_index(self) -> int:
        return self.seqs[0].child_index


class SwapPreemption:
    """Swap-out, swap-in and their undo, over the scheduler's ``host_allocator`` and ``swapped`` queue."""

    def _init_swap(self, preemption_mode: str, host_allocator) -> None:
        self.preemption_mode = preemption_mode
        self.host_allocator = host_allocator
        self.swapped: list[SwappedGroup] = []  # priority order
        self.num_swap_outs = self.num_swap_ins = self.num_swap_fallbacks = 0  # groups
        self.num_swapped_out_blocks = self.num_swapped_in_blocks = 0  # blocks copied each way
        self._new_swap_step()
        self._host_release: list[int] = []  # host blocks read by the last step's swap-ins

    def _new_swap_step(self) -> None:
        self._swap_out: list[BlockSwap] = []
        self._swap_in: list[BlockSwap] = []
        self._swapped_out_step: list[SwappedGroup] = []
        self._swapped_in_step: list[Sequence] = []

    def _release_host_blocks(self) -> None:
        if self._host_release:
            self.host_allocator.release(self._host_release)
            self._host_release = []

    def _swap_out_group(self, group: list[Sequence], content: dict[int, int]) -> bool:
        """Swap ``group`` out (False: the host pool cannot take it; nothing changed). ``content`` maps a
        copy-on-write destination planned in this step, whose copy is dropped, to the block whose KV it
        was to receive."""
        bm, host = self.block_manager, self.host_allocator
        ids = [s.seq_id for s in group]
        need = bm.num_distinct_blocks(ids)
        if need > host.num_free_blocks:
            self.num_swap_fallbacks += 1
            return False
        tables = bm.swap_out(ids)
        host_ids = host.take(need)
        self._swap_out.extend(BlockSwap(content.get(d, d), h) for d, h in zip(tables.block_ids, host_ids))
        swapped = SwappedGroup(list(group), tables, host_ids)
        for seq in group:
            self.running.remove(seq)
            seq.status = SequenceStatus.WAITING
            seq.num_preemptions += 1  # its block-table row is stale (see step_inputs)
            self.num_preemptions += 1
        priority_order.insort(self.swapped, swapped)
        self._swapped_out_step.append(swapped)
        self.num_swap_outs += 1
        self.num_swapped_out_blocks += need
        return True

    def _swap_in_groups(self, chunks: list[ScheduledChunk], copies: list[BlockCopy], budget: int,
                        seats: int) -> tuple[int, int, bool]:
        """Swap groups in, oldest first, while they fit; returns the budget and seats left and whether
        the head group is still out (then nothing new is admitted)."""
        bm = self.block_manager
        while self.swapped and budget > 0:
            group = self.swapped[0]
            if group in self._swapped_out_step:
                return budget, seats, True
            seqs = group.seqs
            need = (bm.swap_in_blocks_needed(group.tables) + self.watermark_blocks
                    + sum(1 for s in seqs if s.num_table_tokens < s.num_tokens))
            if need > bm.num_free_blocks or seats + sum(s.seats for s in seqs) > self.max_num_seqs:
                if not self.running and not chunks:  # it would wait for room that never comes
                    self._recompute_swapped(group)
                    continue
                return budget, seats, True
            placed = bm.swap_in(group.tables)
            self._swap_in.extend(BlockSwap(group.host_ids[i], d) for i, d in placed)
            self._host_release.extend(group.host_ids)
            del self.swapped[0]
            self.num_swap_ins += 1
            self.num_swapped_in_blocks += len(placed)
            # every sequence of the group holds device blocks now: all are the step's to undo, even those
            # the loop below does not reach when planning fails in it
            self._swapped_in_step.extend(seqs)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                priority_order.insort(self.running, seq)
                seats += seq.seats
                if seq.num_table_tokens < seq.num_tokens:  # room was counted above: cannot fail
                    pairs = bm.append_token(seq.seq_id, seq.token_ids[-1])
                    seq.num_table_tokens += 1
                    copies.extend(BlockCopy(src, dst) for src, dst in pairs)
                n = min(seq.num_uncomputed_tokens, budget)
                if n > 0:
                    chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                    budget -= n
        return budget, seats, False

    def _recompute_swapped(self, group: SwappedGroup) -> None:
        """Turn a swapped group into recompute-preempted sequences (host blocks released)."""
        self.swapped.remove(group)
        self.host_allocator.release(group.host_ids)
        for seq in group.seqs:
            seq.num_computed_tokens = seq.num_table_tokens = seq.num_admitted_tokens = 0
            self.add(seq)

    def _undo_swaps(self) -> None:
        """roll_back's part: see the module docstring."""
        bm = self.block_manager
        for seq in self._swapped_in_step:
            if not bm.has_sequence(seq.seq_id):  # (a chunk of the step: roll_back freed and queued it)
                continue
            bm.free(seq.seq_id)
            if seq in self.running:  # else planning failed before it was marked running
                self.running.remove(seq)
            seq.num_computed_tokens = seq.num_table_tokens = seq.num_admitted_tokens = 0
            seq.num_preemptions += 1
            self.add(seq)
        for group in self._swapped_out_step:
            if group in self.swapped:
                self._recompute_swapped(group)
        self._new_swap_step()
        self._release_host_blocks()

    def _drop_swapped(self, seq: Sequence) -> bool:
        """Forget a swapped sequence that ends (abort, a pruned beam); False when it is not swapped."""
        for group in self.swapped:
            if seq in group.seqs:
                group.seqs.remove(seq)
                group.tables.drop(seq.seq_id)
                if not group.seqs:
                    self.swapped.remove(group)
                    self.host_allocator.release(group.host_ids)
                return True
        return False
