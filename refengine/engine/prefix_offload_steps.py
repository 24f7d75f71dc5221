"""The prefix cache's host tier in the step (``LLM(kv_offloading_size=GiB)``): the block manager plans
the copies (an evicted cached block stored to the host tier, a host hit loaded back,
``kv/prefix_offload.py``); the scheduler puts them in the step it plans and commits or undoes them with
the step.

* planning: every copy the manager planned while the step was planned goes into
  ``SchedulerOutput.offload_store`` / ``offload_load``, one batch each; the executor applies the stores
  with the swap-outs and the loads with the swap-ins, before the copy-on-write copies and the forward;
* ``update`` (the step ran, so its copies did): the manager commits them (host entries unpinned);
* ``roll_back`` (the copies may not have run): the entries the step stored are dropped, the blocks it
  loaded unpublished (no later prompt may hit KV that was perhaps never copied), and every sequence
  holding one is recompute-preempted: those the step gave a chunk as every rolled-back sequence, the
  others (a group's later member admitted without a chunk) here.

A mixin of :class:`~pagedbench.refengine.engine.scheduler.Scheduler`.
"""

from __future__ import annotations

from pagedbench.refengine.engine.schedule_plan import BlockCopy, BlockSwap, ScheduledChunk, SchedulerOutput


class PrefixOffloadSteps:
    """The step's host-tier copies and their undo, over the scheduler's ``block_manager``."""

    def _output_with_offload(self, chunks: list[ScheduledChunk], copies: list[BlockCopy], preempted: list[int],
                             num_batched_tokens: int) -> SchedulerOutput:
        stores, loads = self.block_manager.take_offload_copies()
        return SchedulerOutput(tuple(chunks), tuple(copies), tuple(preempted), num_batched_tokens,
                               tuple(self._swap_out), tuple(self._swap_in),
                               offload_store=tuple(BlockSwap(d, h) for d, h in stores),
                               offload_load=tuple(BlockSwap(h, d) for h, d in loads))

    def _undo_offload(self, touched: set[int]) -> None:
        """roll_back's part (module docstring); ``touched``: ids of the sequences roll_back preempts itself."""
        bm = self.block_manager
        loaded = set(bm.undo_offload_step())
        if not loaded:
            return
        for seq in [s for s in self.running if id(s) not in touched]:
            if loaded.isdisjoint(bm.block_table(seq.seq_id)):
                continue
            bm.free(seq.seq_id)
            self.running.remove(seq)
            seq.num_computed_tokens = seq.num_table_tokens = seq.num_admitted_tokens = 0
            seq.num_preemptions += 1  # its block-table row is stale (see step_inputs)
            self.add(seq)
