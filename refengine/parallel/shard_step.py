"""What every rank runs in a step, and the ledger each rank keeps of its KV pool.

Rank 0's scheduler plans the step and rank 0's executor turns the plan into host arrays (its persistent
block tables are the only ones: the scheduler's live :class:`Sequence` objects never leave rank 0). The
:class:`ShardStep` it broadcasts is those arrays and the copy-on-write copies, nothing else: a rank needs
no sequence, generator or block manager to run its slice of the model over its own pool, whose block
ids are rank 0's (every pool has the same ``num_blocks``; only the KV heads differ).

:class:`KVLedger` is a rank's account of its pool: the token whose K/V each slot holds (-1: never
written), kept by the same code on every rank from the steps it ran. Rank 0 compares every rank's with
its own and with its block manager (:meth:`KVLedger.mismatches`), so a rank that skipped a copy or
wrote a slot elsewhere shows up even where the tokens happen to agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pagedbench.refengine.model.attention_backend import AttentionMetadata


@dataclass(frozen=True, slots=True)
class ShardStep:
    """One step as every rank runs it: copy ``copies`` (src, dst block ids) first, then the model over
    T tokens of S sequences (the arrays of
    :class:`~pagedbench.refengine.engine.step_inputs.StepInputs`). ``num_tokens == 0``: copies only."""

    copies: tuple[tuple[int, int], ...]
    input_ids: np.ndarray | None  # int64 [T]
    positions: np.ndarray | None  # int64 [T]
    slot_mapping: np.ndarray | None  # int64 [T]
    block_tables: np.ndarray | None  # int32 [S, max_blocks]
    seq_lens: np.ndarray | None  # int64 [S]
    query_lens: np.ndarray | None  # int64 [S]

    @property
    def num_tokens(self) -> int:
        return 0 if self.input_ids is None else len(self.input_ids)


class KVLedger:
    """``slot_token[slot]``: the token whose K/V this rank's pool holds in ``slot`` (int64, -1: none).

    Invariant: equal on every rank after every step (the same copies and writes were applied), and for
    every sequence the block manager holds, its computed positions' slots hold its tokens.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slot_token = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.num_steps = 0  # steps applied (copies-only steps included)

    def apply(self, step: ShardStep) -> None:
        bs = self.block_size
        by_block = self.slot_token.reshape(-1, bs)
        for src, dst in step.copies:
            by_block[dst] = by_block[src]
        if step.num_tokens:
            self.slot_token[step.slot_mapping] = step.input_ids
        self.num_steps += 1

    def mismatches(self, block_manager, sequences) -> list[str]:
        """What in this ledger contradicts ``block_manager`` for ``sequences`` (each with ``seq_id``,
        ``token_ids``, ``num_computed_tokens``): one line per sequence whose slots hold other tokens."""
        bad = []
        bs = self.block_size
        for seq in sequences:
            if not block_manager.has_sequence(seq.seq_id):
                continue
            table = np.asarray(block_manager.block_table(seq.seq_id), dtype=np.int64)
            n = seq.num_computed_tokens
            pos = np.arange(n)
            held = self.slot_token[table[pos // bs] * bs + pos % bs]
            want = np.asarray(seq.token_ids[:n], dtype=np.int64)
            if not np.array_equal(held, want):
                first = int(np.flatnonzero(held != want)[0])
                bad.append(f"sequence {seq.seq_id} position {first}: slot holds token {int(held[first])}, "
                           f"expected {int(want[first])}")
        return bad


def run_shard_step(model, pool, kv_caches, step: ShardStep, ledger: KVLedger
                   ) -> tuple[torch.Tensor | None, AttentionMetadata | None]:
    """Apply ``step``'s copies to this rank's ``pool`` and run this rank's shard of ``model`` over its
    tokens (the row-parallel layers meet the other ranks in their all-reduces); returns the final hidden
    states [T, hidden] (whole, identical on every rank) and the step's metadata, or Nones for a
    copies-only step."""
    if step.copies:
        pool.copy_blocks(step.copies)
    hidden = meta = None
    if step.num_tokens:
        device = model.device
        meta = AttentionMetadata.from_host(
            block_tables=step.block_tables, seq_lens=step.seq_lens, query_lens=step.query_lens,
            slot_mapping=step.slot_mapping, device=device, block_size=pool.block_size,
            num_blocks=pool.num_blocks)
        plan = getattr(getattr(model, "attention_backend", None), "plan", None)
        if plan is not None:
            meta = plan(meta, pool.block_size)
        ids = torch.from_numpy(step.input_ids).to(device)
        pos = torch.from_numpy(step.positions).to(device)
        hidden = model.forward(ids, pos, meta, kv_caches)
    ledger.apply(step)
    return hidden, meta
