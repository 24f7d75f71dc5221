"""What the scheduler does once a step has run: record it, or undo it.

:meth:`update`, after the engine ran the step and sampled, advances the computed counts, forks the
children of a parallel-sampling request whose prefill just completed (they share its blocks;
copy-on-write separates them as they append), appends sampled tokens, and finishes sequences, freeing
their blocks at once.

A step that raises anywhere between ``Scheduler.schedule`` and the end of :meth:`update` is undone by
:meth:`roll_back`: every sequence the step touched (each one given a chunk, and the children forked
from them) is preempted for recomputation with the tokens it had before the step; see its docstring
for why this and not an exact undo.

A mixin of :class:`~pagedbench.refengine.engine.scheduler.Scheduler`, kept apart because planning a
step and recording it are two readings: it uses the scheduler's queues (``running``, ``waiting``), its
``block_manager``, ``stop`` rule, ``prefix_caching`` flag and the plan of the last step (``_plan``,
``_forks``).
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedbench.refengine.engine import priority_order
from pagedbench.refengine.engine.schedule_plan import SchedulerOutput
from pagedbench.refengine.engine.sequence import Sequence, SequenceStatus


class StepUpdate:
    """:meth:`update`, :meth:`roll_back`, and the finishing and forking they do."""

    def update(self, out: SchedulerOutput, sampled: Mapping[int, int]) -> list[Sequence]:
        """Record a finished step; ``sampled`` maps seq_id -> new token for every sequence that sampled
        (including the children of a just-prefilled parallel-sampling request). Returns the sequences
        that finished (their blocks already freed)."""
        bm = self.block_manager
        bs = bm.block_size
        publish = self.prefix_caching
        if self._host_release:  # the step ran: its swap-ins have read these host blocks
            self._release_host_blocks()
        if self.offloading:  # the step ran: its host-tier copies too
            bm.commit_offload_step()
        finished: list[Sequence] = []
        used = 0  # tokens of ``sampled`` taken: each must belong to a sequence that sampled
        eos, max_len = self.stop.eos_token_ids, self.stop.max_model_len
        # one pass over the step's chunks (this runs once per sequence per step): the common case of a
        # sequence that sampled one token is handled inline, forks and finishing in methods
        for chunk in out.chunks:
            seq = chunk.seq
            end = seq.num_computed_tokens = chunk.end
            # the step wrote these tokens' K/V: their full blocks may be cached. A one-token chunk can
            # complete a block only when it ends on a block boundary (the commonest step skips the call)
            if publish and (chunk.num_tokens > 1 or end % bs == 0):
                bm.publish_blocks(seq.seq_id, end)
            if not chunk.samples:
                continue
            if seq.pending_children:
                for s in self._fork_children(seq):
                    if s.seq_id in sampled:
                        used += 1
                        s.token_ids.append(sampled[s.seq_id])
                        self._finish(s, s.token_ids[-1], finished)
                continue
            token = sampled.get(seq.seq_id)
            if token is None:
                continue
            used += 1
            tokens = seq.token_ids
            tokens.append(token)
            p = seq.params
            n = len(tokens)
            # a cheap test first; _finish names the reason
            if (n - seq.num_prompt_tokens < p.max_tokens and n <= max_len and token not in p.stop_token_ids
                    and (p.ignore_eos or token not in eos)):
                continue
            self._finish(seq, token, finished)
        if used != len(sampled):
            raise RuntimeError(f"the executor returned tokens for {len(sampled)} sequences, of which "
                               f"{used} sampled this step")
        if finished:  # one pass, not a list.remove per finished sequence (quadratic when a batch ends)
            done = SequenceStatus.FINISHED
            self.running[:] = [s for s in self.running if s.status is not done]
        self.peak_running = max(self.peak_running, len(self.running))
        return finished

    def _fork_children(self, seq: Sequence) -> list[Sequence]:
        """Fork ``seq``'s pending children from its just-computed prompt; returns ``seq`` and them."""
        children = seq.pending_children
        self._forks.append((seq, children))
        for child in children:
            self.fork(seq, child)
        seq.pending_children = []
        return [seq, *children]

    # --- a failed step ------------------------------------------------------------------------------
    def roll_back(self) -> list[Sequence]:
        """Undo the last step planned, which raised somewhere in planning, running or :meth:`update`:
        every sequence it gave a chunk is preempted for recomputation (blocks freed, back in the waiting
        queue) with the tokens it had before the step, and children forked in the failed update become
        its pending children again. Returns those sequences, in the step's order.

        Why recompute-preempt rather than an exact undo: the plan changes the block manager in ways
        that are not cheaply reversible (admissions may evict prefix-cached blocks, appends copy on
        write, planning preempts victims, the update publishes and frees), so an exact undo would
        need a journal of the block manager on every step's path, for an event that is rare. Freeing
        the touched sequences costs nothing until a step fails and goes through the path every
        preemption takes: a table that pointed at a copy that never ran, or at KV half written by a
        failed forward, is dropped with its blocks; what the step published was written by a forward
        that completed. The sequences the plan preempted are already waiting, whole. The caller rewinds
        the samplers' generators (a sequence draws once per generated token).

        With swap preemption, groups the step swapped out and sequences it swapped in (with or without
        a chunk) are recompute-preempted too, and their host blocks released: their copies may not have
        run (``engine/swap_preemption.py``). With the prefix cache's host tier, the entries the step
        stored are dropped, the blocks it loaded unpublished and every sequence holding one
        recompute-preempted (``engine/prefix_offload_steps.py``).
        """
        plan, forks = self._plan, self._forks
        self._plan, self._forks = [], []
        bm = self.block_manager
        touched = {id(c.seq) for c in plan}
        if self.offloading:  # before the tables are freed: the blocks it loaded are unpublished while held
            self._undo_offload(touched)
        for parent, children in forks:
            for child in children:
                touched.add(id(child))
                if bm.has_sequence(child.seq_id):
                    bm.free(child.seq_id)
                del child.token_ids[child.num_prompt_tokens:]
                child.status = SequenceStatus.WAITING
                child.finish_reason = None
                child.num_computed_tokens = child.num_table_tokens = 0
            parent.pending_children = children
        self.running[:] = [s for s in self.running if id(s) not in touched]
        self.waiting[:] = [s for s in self.waiting if id(s) not in touched]  # none, unless planning broke
        seqs = []
        for chunk in plan:
            seq = chunk.seq
            if chunk.samples:  # the update may have appended the step's token, the loop its logprobs
                del seq.token_ids[chunk.end:]
                for s in (seq, *seq.pending_children):  # children not forked yet got logprobs too
                    if s.logprobs is not None:
                        del s.logprobs[s.num_output_tokens:]
            if bm.has_sequence(seq.seq_id):
                bm.free(seq.seq_id)
            seq.finish_reason = None
            seq.finish_s = None
            seq.num_computed_tokens = seq.num_table_tokens = seq.num_admitted_tokens = 0
            seq.num_preemptions += 1  # its block-table row is stale (see step_inputs)
            self.add(seq)
            seqs.append(seq)
        if self.preemption_mode == "swap":
            self._undo_swaps()
        self.num_rollbacks += 1
        return seqs

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run ``child`` on ``parent``'s blocks (shared until one of them appends into a shared block).

        ``parent`` is running with every token in its table computed; ``child.token_ids`` starts with
        those tokens (it may hold one more, its next token, which the next step appends).
        """
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.status = SequenceStatus.RUNNING
        child.num_computed_tokens = child.num_table_tokens = parent.num_table_tokens
        priority_order.insort(self.running, child)

    def finish_now(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` outside a step's update (beam search prunes a beam or ends its request): its
        blocks, if it holds any, are freed at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.free(seq.seq_id)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif self.swapped:
            self._drop_swapped(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _finish(self, seq: Sequence, token: int, finished: list[Sequence]) -> None:
        """Finish ``seq`` (its blocks freed) if ``token``, just appended, ends it."""
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self.block_manager.free(seq.seq_id)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            finished.append(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        n = len(seq.token_ids)
        if n - seq.num_prompt_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.stop.eos_token_ids:
                return "eos"
            if token in p.stop_token_ids:
                return "stop"
        if n - seq.num_prompt_tokens >= p.max_tokens or n > self.stop.max_model_len:
            return "length"
        return None
