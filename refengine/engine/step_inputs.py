"""The model executor's host-side view of a step: persistent block-table rows, then the step's inputs
(token ids, positions, slot mapping, block tables, lengths) computed with vector operations.

Block tables live in one persistent int32 array ``[num_rows, max_blocks]``; a sequence keeps its row
from step to step and the row is rewritten from the block manager only when it may have changed:

* the sequence has no row yet (first step, or its row was taken by another sequence);
* it was preempted since the row was written (``Sequence.num_preemptions``: its blocks were freed and
  it was allocated again, maybe elsewhere);
* it now needs more blocks than the row holds (it grew by appends);
* the step has copy-on-write copies (an append replaced a sequence's shared last block).

Those are the only ways a running sequence's table changes: allocation happens at admission,
``append_token`` adds a block at the end or replaces the last one (a copy, listed in the step), a fork
gives the child a new sequence id, and publishing to the prefix cache never moves a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pagedbench.refengine.engine.scheduler import SchedulerOutput
from pagedbench.refengine.kv.table_padding import PAD_BLOCK_ID


@dataclass(frozen=True, slots=True)
class StepInputs:
    """A step's host arrays, S chunks and T tokens, in the scheduler's batch order."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]: each token's position in its sequence
    slot_mapping: np.ndarray  # int64 [T]: block_table[pos // block_size] * block_size + pos % block_size
    block_tables: np.ndarray  # int32 [S, max_blocks]: the rows this step reads (a copy)
    seq_lens: np.ndarray  # int64 [S]: tokens in the cache after the step (chunk end)
    query_lens: np.ndarray  # int64 [S]: tokens computed this step


class HostBlockTables:
    """Block tables of the sequences the executor has seen, one persistent row each (see the module).

    Invariant: for ``seq_id`` in ``row_of``, ``table[row, :num_blocks[row]]`` equals the block manager's
    table of that sequence as of the last write, and ``written_preemptions[row]`` its
    ``num_preemptions`` then; columns past ``num_blocks[row]`` hold ``PAD_BLOCK_ID``. Rows are taken
    from the free list, else from a sequence not in the current step (it is rewritten if it returns).
    """

    def __init__(self, block_manager, block_size: int, num_rows: int = 64, max_blocks: int = 16) -> None:
        self.block_manager = block_manager
        self.block_size = block_size
        self.table = np.full((num_rows, max_blocks), PAD_BLOCK_ID, dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)  # blocks written in each row
        self.written_preemptions = np.zeros(num_rows, dtype=np.int64)
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.seq_of: dict[int, int] = {}  # row -> seq_id
        self.num_row_writes = 0  # rows rewritten whole so far (tests and benchmarks read it)
        self.num_row_extends = 0  # rows that had blocks appended

    def rows(self, out: SchedulerOutput, ends: np.ndarray | None = None) -> np.ndarray:
        """int64 [S]: the row of each chunk's sequence, every row brought up to date (see the module).
        ``ends``: the chunks' ends, if the caller has them already."""
        chunks = out.chunks
        if ends is None:
            ends = np.fromiter((c.end for c in chunks), dtype=np.int64, count=len(chunks))
        row_of = self.row_of
        found = [row_of.get(c.seq.seq_id, -1) for c in chunks]
        rows = np.array(found, dtype=np.int64)
        # which known rows are stale, in one vector test rather than one per sequence
        preemptions = np.fromiter((c.seq.num_preemptions for c in chunks), dtype=np.int64, count=len(chunks))
        known = np.maximum(rows, 0)
        stale = (rows < 0) | (self.written_preemptions[known] != preemptions)
        if out.copies:
            stale[:] = True
        # a sequence that only grew keeps its row's blocks: the new ones are appended in one vector write
        # (a full rewrite per new block was most of this method's cost in a long decode)
        grown = np.flatnonzero(~stale & (self.num_blocks[known] * self.block_size < ends))
        if grown.size:
            self._extend(rows[grown], [chunks[i].seq.seq_id for i in grown.tolist()])
        todo = np.flatnonzero(stale)
        if todo.size:
            step_ids = {c.seq.seq_id for c in chunks}
            for i in todo.tolist():
                seq = chunks[i].seq
                row = found[i]
                if row < 0:
                    row = self._take_row(seq.seq_id, step_ids)
                    rows[i] = row
                self._write(row, seq)
        return rows

    def _extend(self, rows: np.ndarray, seq_ids: list[int]) -> None:
        """Append the blocks each of ``seq_ids`` gained since its row (in ``rows``) was written."""
        block_table = self.block_manager.block_table
        tables = [block_table(s) for s in seq_ids]
        have = self.num_blocks[rows].tolist()
        longest = max(map(len, tables))
        if longest > self.table.shape[1]:
            self._grow(cols=max(longest, 2 * self.table.shape[1]))
        r_idx: list[int] = []
        c_idx: list[int] = []
        ids: list[int] = []
        for row, start, table in zip(rows.tolist(), have, tables):
            r_idx.extend([row] * (len(table) - start))
            c_idx.extend(range(start, len(table)))
            ids.extend(table[start:])
        self.table[r_idx, c_idx] = ids
        self.num_blocks[rows] = [len(t) for t in tables]
        self.num_row_extends += len(seq_ids)

    def _take_row(self, seq_id: int, step_ids: set[int]) -> int:
        num_rows = self.table.shape[0]
        if len(self.seq_of) < num_rows:
            row = next(r for r in range(num_rows) if r not in self.seq_of)
        else:
            victim = next((s for s in self.row_of if s not in step_ids), None)
            if victim is None:  # every row serves this step: double the table
                self._grow(rows=2 * num_rows)
                row = num_rows
            else:
                row = self.row_of.pop(victim)
        self.row_of[seq_id], self.seq_of[row] = row, seq_id
        return row

    def _write(self, row: int, seq) -> None:
        ids = self.block_manager.block_table(seq.seq_id)
        if len(ids) > self.table.shape[1]:
            self._grow(cols=max(len(ids), 2 * self.table.shape[1]))
        self.table[row, :len(ids)] = ids
        self.table[row, len(ids):] = PAD_BLOCK_ID
        self.num_blocks[row] = len(ids)
        self.written_preemptions[row] = seq.num_preemptions
        self.num_row_writes += 1

    def _grow(self, *, rows: int | None = None, cols: int | None = None) -> None:
        r, c = self.table.shape
        bigger = np.full((rows or r, cols or c), PAD_BLOCK_ID, dtype=np.int32)
        bigger[:r, :c] = self.table
        self.table = bigger
        if rows:
            self.num_blocks = np.concatenate((self.num_blocks, np.zeros(rows - r, dtype=np.int64)))
            self.written_preemptions = np.concatenate(
                (self.written_preemptions, np.zeros(rows - r, dtype=np.int64)))

    def check(self, out: SchedulerOutput) -> None:
        """Raise AssertionError if a row of this step differs from the block manager (tests)."""
        for chunk in out.chunks:
            row = self.row_of[chunk.seq.seq_id]
            want = self.block_manager.block_table(chunk.seq.seq_id)
            got = self.table[row, :self.num_blocks[row]].tolist()
            if got != want:
                raise AssertionError(f"block-table row of sequence {chunk.seq.seq_id}: {got} != {want}")

    def step_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step's host arrays (see :class:`StepInputs`)."""
        chunks = out.chunks
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        ends = np.fromiter((c.end for c in chunks), dtype=np.int64, count=len(chunks))
        rows = self.rows(out, ends)
        query_lens = ends - starts
        bs = self.block_size
        max_blocks = int(-(-ends.max() // bs))
        tables = self.table[rows, :max_blocks]
        seq_index = np.repeat(np.arange(len(chunks)), query_lens)
        first_row = np.cumsum(query_lens) - query_lens  # each chunk's first row in T
        positions = np.arange(int(query_lens.sum())) + np.repeat(starts - first_row, query_lens)
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        if len(positions) == len(chunks):  # decodes only: one token each
            ids = np.fromiter((c.seq.token_ids[c.start] for c in chunks), dtype=np.int64, count=len(chunks))
        else:
            token_list: list[int] = []
            for c in chunks:
                token_list.extend(c.seq.token_ids[c.start:c.end])
            ids = np.asarray(token_list, dtype=np.int64)
        return StepInputs(ids, positions, slots, tables, ends, query_lens)
