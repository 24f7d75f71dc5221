"""A table's growth: appends, one token or a run of them, and the copy-on-write of a shared last block.

An append into a full last block takes a fresh one; an append into a partial last block that other
tables share (after a fork) first moves the writer to a fresh block and reports the ``(src, dst)`` copy
the caller applies to the KV data, so a shared block is never written. With ``publish=True`` a block
filled by an append is published into the prefix cache once full, if every earlier token is written.

A mixin of :class:`~pagedbench.refengine.kv.block_manager.BlockManager` (whose state it reads and
changes through the same private fields as the manager's own methods).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from pagedbench.refengine.errors import InvalidArgumentError, OutOfBlocksError
from pagedbench.refengine.kv.token_checks import MAX_TOKEN, checked_token_id


class TableGrowth:
    """:meth:`append_token`, :meth:`append_tokens` and the copy-on-write hook of
    :class:`~pagedbench.refengine.kv.block_manager.BlockManager`."""

    __slots__ = ()

    def append_token(self, seq_id: Hashable, token_id: int) -> list[tuple[int, int]]:
        """Make room for one more token; return the ``(src, dst)`` block copies copy-on-write needs.

        Raises OutOfBlocksError (nothing changed) when a block is needed and none is free.
        """
        # called once per running sequence per step: the lookup and the copy-on-write test are inline
        try:
            seq = self._seqs[seq_id]
        except (KeyError, TypeError):
            seq = self._get(seq_id)  # raises the error that names the problem
        if type(token_id) is not int or not 0 <= token_id < MAX_TOKEN:
            token_id = checked_token_id(token_id)
        if seq.num_late:
            seq.settle_late_tokens()
        tokens = seq.token_ids
        n = len(tokens)
        bs = self._block_size
        copy = None
        if n % bs == 0:
            if not self._free and not self._cached:
                raise OutOfBlocksError(
                    f"sequence {seq_id!r} needs a new block for token {n} but none is free")
            seq.blocks.append(self._take_fresh())
            self._table_blocks += 1
        elif seq.blocks[-1].ref_count != 1:
            copy = self._copy_on_write_last_block(seq)
        tokens.append(token_id)
        self._live_tokens += 1 if copy is None else n % bs + 1  # a copy holds the block's tokens again
        if seq.auto_publish and seq.num_computed == n:  # the tokens before it are written: so is this one
            seq.num_computed = n + 1
            if (n + 1) % bs == 0 and self.enable_prefix_caching:
                self._publish(seq, (n + 1) // bs)
        return [] if copy is None else [copy]

    def append_tokens(self, seq_id: Hashable, token_ids: Iterable[int]) -> None:
        """Make room for several tokens at once, leaving the state ``append_token`` would leave after
        one call per token (blocks taken, and with prefix caching blocks published, block by block in
        the same order), for a caller that knows no copy-on-write is due (the serving simulator's runs
        of decode steps).

        Raises OutOfBlocksError when the blocks they need are not all free, and InvalidArgumentError when
        the last block is shared (a copy-on-write is due: append one token at a time); nothing changes.
        """
        seq = self._get(seq_id)
        new = list(token_ids)
        if not new:
            return
        if set(map(type, new)) != {int} or min(new) < 0 or max(new) >= MAX_TOKEN:  # at C speed
            for t in new:
                checked_token_id(t)  # raises the error that names the bad one
            new = [checked_token_id(t) for t in new]  # numpy or torch scalars: plain ints
        tokens = seq.token_ids
        n, m, bs = len(tokens), len(new), self._block_size
        if n % bs and seq.blocks[-1].ref_count != 1:
            raise InvalidArgumentError(f"sequence {seq_id!r} shares its last block {seq.blocks[-1].block_id}: "
                                       "a copy-on-write is due, append one token at a time")
        need = -(-(n + m) // bs) - -(-n // bs)
        if need > self._free.length + self._cached.length:
            raise OutOfBlocksError(f"sequence {seq_id!r} needs {need} new blocks for {m} tokens but only "
                                   f"{self._free.length + self._cached.length} are free")
        publish = seq.auto_publish and seq.num_computed == n
        i = 0
        while i < m:  # one block (or the rest of the last one) at a time
            if len(tokens) % bs == 0:
                seq.blocks.append(self._take_fresh())
                self._table_blocks += 1
            take = min(m - i, bs - len(tokens) % bs)
            tokens.extend(new[i:i + take])
            i += take
            if publish:
                seq.num_computed = len(tokens)
                if len(tokens) % bs == 0 and self.enable_prefix_caching:
                    self._publish(seq, len(tokens) // bs)
        self._live_tokens += m

    def _copy_on_write_last_block(self, seq) -> tuple[int, int] | None:
        """The copy-on-write hook, called before a token is written into ``seq``'s partial last block.

        If other tables share that block, move ``seq`` to a fresh block and return ``(src, dst)``: the
        caller copies the KV of ``src`` into ``dst``. Returns None when the block is ``seq``'s alone.
        Raises OutOfBlocksError, changing nothing, when a copy is needed and no block is free.
        """
        last = seq.blocks[-1]
        if last.ref_count == 1:
            return None
        if not self._free and not self._cached:
            raise OutOfBlocksError(
                f"copy-on-write of shared block {last.block_id} needs a free block but none is free")
        fresh = self._take_fresh()
        last.ref_count -= 1
        seq.blocks[-1] = fresh
        self._copy_on_write_copies += 1
        return (last.block_id, fresh.block_id)

