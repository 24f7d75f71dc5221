"""Swapping a group's block tables out of the block manager and back (swap preemption's bookkeeping).

:meth:`SwapTables.swap_out` takes a group of sequences (a request's samples, sharing blocks after a
fork) off the device: their distinct blocks are listed once each (a block shared by k tables is copied
once) and their tables freed as :meth:`free` frees them, so published blocks stay in the prefix cache
as evictable, exactly as when freed. The sequences' state (tokens, computed count, prefix-chain
position) is kept in the returned :class:`SwappedTables`, their tables as indices into that list.

:meth:`SwapTables.swap_in` gives them fresh device blocks, one per distinct block still referenced, in
the same sharing (ref counts as before the swap-out). The fresh blocks are unpublished: the host copy is
not re-registered in the prefix cache (the simplest correct choice; blocks the sequence publishes later
chain off the content ids its chain had reached, which name content, not block ids, so no block ever
claims a hash its content lacks).

A mixin of :class:`~pagedbench.refengine.kv.block_manager.BlockManager`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedbench.refengine.errors import InvalidArgumentError, OutOfBlocksError


class SwappedTables:
    """A group's tables while off the device (opaque to all but the block manager)."""

    __slots__ = ("block_ids", "seqs", "tables")

    def __init__(self, block_ids: list[int], seqs: dict, tables: dict[Hashable, list[int]]) -> None:
        self.block_ids = block_ids  # the group's distinct device blocks at swap-out, first-seen order
        self.seqs = seqs  # seq_id -> the manager's sequence state, its blocks emptied
        self.tables = tables  # seq_id -> its table as indices into block_ids

    def used_indices(self) -> list[int]:
        """Indices into ``block_ids`` some kept table still references, ascending."""
        return sorted({i for t in self.tables.values() for i in t})

    def drop(self, seq_id: Hashable) -> None:
        """Forget one sequence (it finished while swapped out)."""
        self.seqs.pop(seq_id, None)
        self.tables.pop(seq_id, None)


class SwapTables:
    """:meth:`num_distinct_blocks`, :meth:`swap_out` and :meth:`swap_in` of the BlockManager."""

    __slots__ = ()

    def num_distinct_blocks(self, seq_ids: Sequence[Hashable]) -> int:
        """Distinct blocks the tables of ``seq_ids`` hold together (a shared block once)."""
        return len({b.block_id for sid in seq_ids for b in self._lookup_seq(sid).blocks})

    def swap_out(self, seq_ids: Sequence[Hashable]) -> SwappedTables:
        """Free the tables of ``seq_ids`` (as :meth:`free`), keeping their state; see the module docstring."""
        seqs = [self._get(sid) for sid in seq_ids]  # (late tokens written: they go with the state)
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgumentError(f"swap_out: a sequence given twice in {list(seq_ids)}")
        index: dict[int, int] = {}
        tables: dict[Hashable, list[int]] = {}
        for sid, seq in zip(seq_ids, seqs):
            tables[sid] = [index.setdefault(b.block_id, len(index)) for b in seq.blocks]
        for sid in seq_ids:
            self.free(sid)
        for seq in seqs:
            seq.blocks = []
        return SwappedTables(list(index), dict(zip(seq_ids, seqs)), tables)

    def swap_in_blocks_needed(self, swapped: SwappedTables) -> int:
        return len(swapped.used_indices())

    def swap_in(self, swapped: SwappedTables) -> list[tuple[int, int]]:
        """Re-create the swapped tables on fresh device blocks; returns ``(index, device_block_id)`` for
        each distinct block placed (``index`` into ``swapped.block_ids``). Raises OutOfBlocksError,
        changing nothing, when too few blocks are free."""
        used = swapped.used_indices()
        for sid in swapped.tables:
            self._check_new_seq_id(sid)
        free = self._free.length + self._cached.length
        if len(used) > free:
            raise OutOfBlocksError(f"swap-in needs {len(used)} free blocks but only {free} are free")
        fresh = dict(zip(used, self._take_fresh_many(len(used))))
        for b in fresh.values():
            b.ref_count = 0
        bs = self._block_size
        tokens_in: dict[int, int] = {}  # index -> tokens the block holds (a shared block's the same in each)
        for sid, table in swapped.tables.items():
            seq = swapped.seqs[sid]
            seq.blocks = [fresh[i] for i in table]
            for pos, i in enumerate(table):
                fresh[i].ref_count += 1
                tokens_in[i] = max(tokens_in.get(i, 0), min(bs, seq.num_tokens - pos * bs))
            self._table_blocks += len(table)
            self._seqs[sid] = seq
        self._live_tokens += sum(tokens_in.values())
        return [(i, fresh[i].block_id) for i in used]
