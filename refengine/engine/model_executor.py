"""The executor that runs the real model: copy-on-write copies, attention metadata, forward, sampling.

It never decides who runs: it executes the :class:`SchedulerOutput` it is given and returns the tokens.
Per step, on the host: the persistent block-table rows are brought up to date and the step's inputs
computed with vector operations (:mod:`step_inputs`), the :class:`AttentionMetadata` is built and
checked once (the launchers then skip their own checks), the attention backend's layout is planned
(``plan``: the CPU backend's padded gather), and nothing is read back from the device until the sampled
tokens.
"""

from __future__ import annotations

import torch
from pagedbench.refengine.engine.core import StepResult
from pagedbench.refengine.engine.logprobs import token_logprobs
from pagedbench.refengine.engine.scheduler import SchedulerOutput
from pagedbench.refengine.engine.step_inputs import HostBlockTables, StepInputs
from pagedbench.refengine.kv.swap_copy import copy_blocks_between
from pagedbench.refengine.model.attention_backend import AttentionMetadata
from pagedbench.refengine.model.sampling import child_generator, rewind_generator, sample_batch


class ModelExecutor:
    """``model`` over the paged KV ``pool``, whose block tables ``block_manager`` keeps.

    ``check_block_tables`` (tests): compare every persistent row a step uses with the block manager.
    ``batch_invariant``: the model's fixed-order arithmetic (a row's logits independent of the batch).
    ``logits_hook`` (tests, studies): called with (seq_ids, float32 logits [len(seq_ids), vocab]) for
    every step that samples, before sampling.
    """

    def __init__(self, model, pool, block_manager, block_size: int, *, batch_invariant: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.block_manager = block_manager
        self.block_size = block_size
        self.kv_caches = pool.kv_caches()
        self.tables = HostBlockTables(block_manager, block_size)
        self.check_block_tables = False
        self.batch_invariant = batch_invariant
        self.logits_hook = None
        self.host_pool = None  # swap preemption's HostBlockPool (the LLM sets it in swap mode)
        self.offload_pool = None  # the prefix cache's host tier, a HostBlockPool (kv_offloading_size)
        # the attention backend's per-step layout (the CPU backend's gather indices and masks), built here
        # so that it counts as host time; the model's forward then finds it built. None: no such step
        self.plan = getattr(getattr(model, "attention_backend", None), "plan", None)

    @staticmethod
    def make_generator(base_seed: int, child_index: int) -> torch.Generator:
        return child_generator(base_seed, child_index)

    @staticmethod
    def rewind_generator(generator: torch.Generator, num_draws: int) -> None:
        rewind_generator(generator, num_draws)

    def execute(self, out: SchedulerOutput) -> StepResult:
        self.apply_copies(out)
        if not out.chunks:  # nothing planned (an idle engine stepped): no model to run
            return StepResult({})
        return self._run(out)

    def _run(self, out: SchedulerOutput) -> StepResult:
        """Run the model on the step's tokens and sample: seq_id -> new token (and logprobs)."""
        samplers, logits = self.forward_logits(out)
        if not samplers:
            return StepResult({})
        if any(s.pending_children for s in samplers):
            # a just-prefilled parent's children sample from its row too
            seqs = [(row, s) for row, parent in enumerate(samplers) for s in (parent, *parent.pending_children)]
            logits = logits[torch.tensor([row for row, _ in seqs], device=logits.device)]
            samplers = [s for _, s in seqs]
        # the sequences are their own token histories (read only for penalties); logits stay raw for logprobs
        tokens = sample_batch(logits, [s.params for s in samplers], [s.generator for s in samplers], samplers)
        sampled = {s.seq_id: t for s, t in zip(samplers, tokens)}
        wanted = [s.params.logprobs for s in samplers]
        if wanted.count(None) == len(wanted):
            return StepResult(sampled)
        rows = token_logprobs(logits, tokens, wanted)
        return StepResult(sampled, logprobs={s.seq_id: e for s, e in zip(samplers, rows) if e is not None})

    def forward_logits(self, out: SchedulerOutput) -> tuple[list, torch.Tensor | None]:
        """Run the model on the step's tokens (its copy-on-write copies already applied); returns the
        sequences that reached their last token and their logits rows (float32 ``[len, vocab]``; None
        when no sequence did). Samples nothing: beam search reads the rows itself."""
        step = self.tables.step_inputs(out)
        if self.check_block_tables:
            self.tables.check(out)
        hidden, meta = self.run_model(step)
        device = self.model.device
        chunks = out.chunks
        samplers = [c.seq for c in chunks if c.samples]  # one per logits row
        if not samplers:
            return [], None
        last = meta.last_token_indices()
        if len(samplers) < len(chunks):
            last = last[torch.tensor([i for i, c in enumerate(chunks) if c.samples], device=device)]
        if self.batch_invariant:
            logits = self.model.compute_logits(hidden[last], batch_invariant=True)
        else:
            logits = self.model.compute_logits(hidden[last])  # float32 [len(samplers), vocab]
        if self.logits_hook is not None:
            self.logits_hook([s.seq_id for s in samplers], logits)
        return samplers, logits

    def run_model(self, step: StepInputs) -> tuple[torch.Tensor, AttentionMetadata]:
        """The model over a step's host arrays: the final hidden states [T, hidden] and the step's metadata
        (the seam a tensor-parallel executor replaces: there every rank runs its shard)."""
        device = self.model.device
        meta = AttentionMetadata.from_host(
            block_tables=step.block_tables, seq_lens=step.seq_lens, query_lens=step.query_lens,
            slot_mapping=step.slot_mapping, device=device, block_size=self.block_size,
            num_blocks=self.pool.num_blocks, batch_invariant=self.batch_invariant)
        if self.plan is not None:
            meta = self.plan(meta, self.block_size)
        ids = torch.from_numpy(step.input_ids).to(device)
        pos = torch.from_numpy(step.positions).to(device)
        return self.model.forward(ids, pos, meta, self.kv_caches), meta

    def apply_swaps(self, out: SchedulerOutput) -> None:
        """Apply the step's copies between the pools, each kind in one batch: every swap-out and offload
        store first (a device block they read may be written by another table this step: a swap-in, a
        load, the forward), then every swap-in and offload load; all before the copy-on-write copies and
        the model."""
        device = self.kv_caches
        if out.swap_out:
            copy_blocks_between(device, self.host_pool.kv_caches(), [(s.src, s.dst) for s in out.swap_out])
        if out.offload_store:
            copy_blocks_between(device, self.offload_pool.kv_caches(), [(s.src, s.dst) for s in out.offload_store])
        if out.swap_in:
            copy_blocks_between(self.host_pool.kv_caches(), device, [(s.src, s.dst) for s in out.swap_in])
        if out.offload_load:
            copy_blocks_between(self.offload_pool.kv_caches(), device, [(s.src, s.dst) for s in out.offload_load])

    def apply_copies(self, out: SchedulerOutput) -> None:
        """Apply the step's swaps (:meth:`apply_swaps`), then its copy-on-write copies to the KV pool
        (before the model runs)."""
        if out.swap_out or out.swap_in or out.offload_store or out.offload_load:
            self.apply_swaps(out)
        if out.copies:
            self.pool.copy_blocks([(c.src, c.dst) for c in out.copies])
