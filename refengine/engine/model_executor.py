"""The executor that runs the real model: copy-on-write copies, attention metadata, forward, sampling.

It never decides who runs: it executes the :class:`SchedulerOutput` it is given and returns the tokens.
"""

from __future__ import annotations

import torch
from pagedbench.refengine.engine.core import StepResult
from pagedbench.refengine.engine.scheduler import SchedulerOutput
from pagedbench.refengine.model.attention_backend import AttentionMetadata
from pagedbench.refengine.model.sampling import child_generator, sample_token


class ModelExecutor:
    """``model`` over the paged KV ``pool``, whose block tables ``block_manager`` keeps."""

    def __init__(self, model, pool, block_manager, block_size: int) -> None:
        self.model = model
        self.pool = pool
        self.block_manager = block_manager
        self.block_size = block_size
        self.kv_caches = pool.kv_caches()

    @staticmethod
    def make_generator(base_seed: int, child_index: int) -> torch.Generator:
        return child_generator(base_seed, child_index)

    def execute(self, out: SchedulerOutput) -> StepResult:
        if out.copies:
            self.pool.copy_blocks([(c.src, c.dst) for c in out.copies])
        return StepResult(self._run(out))

    def _run(self, out: SchedulerOutput) -> dict[int, int]:
        """Run the model on the step's tokens and sample; returns seq_id -> new token."""
        bm, bs = self.block_manager, self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables, seq_lens, query_lens = [], [], []
        for chunk in out.chunks:
            seq, table = chunk.seq, bm.block_table(chunk.seq.seq_id)
            input_ids.extend(seq.token_ids[chunk.start:chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end))
            tables.append(table)
            seq_lens.append(chunk.end)
            query_lens.append(chunk.num_tokens)
        device = self.model.device
        meta = AttentionMetadata.build(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                                       query_lens=query_lens, device=device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        pos = torch.tensor(positions, dtype=torch.int64, device=device)
        hidden = self.model.forward(ids, pos, meta, self.kv_caches)
        rows = [i for i, c in enumerate(out.chunks) if c.samples]
        if not rows:
            return {}
        last = meta.last_token_indices()[torch.tensor(rows, device=device)]
        logits = self.model.compute_logits(hidden[last])  # float32 [len(rows), vocab]
        greedy = logits.argmax(dim=-1).tolist()  # one batched argmax serves every greedy sequence
        cpu_logits = None
        sampled: dict[int, int] = {}
        for row, i in enumerate(rows):
            seq = out.chunks[i].seq
            for s in (seq, *seq.pending_children):
                if s.params.greedy:
                    sampled[s.seq_id] = greedy[row]
                    continue
                if cpu_logits is None:
                    cpu_logits = logits.cpu()
                sampled[s.seq_id] = sample_token(cpu_logits[row], s.params, s.generator)
        return sampled
