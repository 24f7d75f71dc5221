"""Many rounds of appends in one block-manager call: the serving simulator's runs of decode steps.

A run of ``k`` decode steps appends one token to each of ``b`` running sequences per step; made one
``append_token`` call at a time it costs ``k * b`` calls. :meth:`DecodeRounds.append_token_rounds` leaves
the same state from one pass over the sequences plus one event per block taken or published: a table
of ``n`` tokens takes a block on the rounds ``j`` with ``(n + j) % block_size == 0`` and fills one on
those with ``(n + j + 1) % block_size == 0``, so every event's round is known up front, and sorting
them by (round, take before publication, position) gives the order the calls one by one make them in.
:meth:`DecodeRounds.append_token_runs` and :meth:`DecodeRounds.append_token_takes` serve a caller that
tells each sequence its tokens late, pair by pair or up to each block it takes, in the takes' order.

A mixin of :class:`~pagedbench.refengine.kv.block_manager.BlockManager` (whose state it reads and
changes through the same private fields as the manager's own methods).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from pagedbench.refengine.errors import InvalidArgumentError, OutOfBlocksError
from pagedbench.refengine.kv import prefix_hash
from pagedbench.refengine.kv.token_checks import checked_token_id

_MAX_TOKEN = prefix_hash.MAX_TOKEN_ID


class DecodeRounds:
    """:meth:`append_token_rounds` for :class:`~pagedbench.refengine.kv.block_manager.BlockManager`."""

    __slots__ = ()

    def append_token_rounds(self, seq_ids: Iterable[Hashable], token_id: int, num_rounds: int, *,
                            publish_full_blocks: bool = False) -> None:
        """``num_rounds`` rounds of ``append_token(seq_id, token_id)`` over ``seq_ids`` in their order, in
        one call: the same blocks taken in the same order (round by round, and within a round in the order
        of ``seq_ids``), the same state and statistics, for a caller that knows no copy-on-write is due
        (the serving simulator's runs of decode steps, every sequence appending its sampled token).
        ``publish_full_blocks``: after each round's appends, ``publish_blocks(seq_id, n)`` for each
        sequence (in order) whose length ``n`` is then a multiple of ``block_size`` (a caller that marks
        each round's KV written, as the scheduler does after each step).

        The order of the takes and publications is worked out from each table's length, so the cost is
        one pass over the sequences plus one per new or published block, not one call per token (a
        sequence that publishes as it appends, ``allocate(publish=True)``, makes it go round by round).
        Raises, changing nothing: InvalidArgumentError for a repeated sequence or when one's partial last
        block is shared (a copy-on-write is due), OutOfBlocksError when the blocks every round needs are
        not all free (where the rounds one by one would have stopped part way).
        """
        if type(num_rounds) is not int or num_rounds < 0:
            raise InvalidArgumentError(f"num_rounds must be an int >= 0, got {num_rounds!r}")
        token_id = _checked_token(token_id)
        ids = list(seq_ids)
        seqs = self._sequences_of(ids)
        for seq in seqs:
            if seq.num_late:
                seq.settle_late_tokens()
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError("seq_ids must be distinct: a round appends once to each sequence")
        bs, m = self._block_size, len(seqs)
        # every take and publication as (2 * round + kind) * m + position, kind 0 a take, 1 a publication:
        # sorted, the order the rounds one by one make them in
        events, num_takes, span, stride = [], 0, 2 * num_rounds * m, 2 * bs * m
        for i, seq in enumerate(seqs):
            n = len(seq.token_ids)
            if n % bs and seq.blocks[-1].ref_count != 1:
                raise InvalidArgumentError(f"sequence {ids[i]!r} shares its last block {seq.blocks[-1].block_id}: "
                                           "a copy-on-write is due, append one token at a time")
            first = -n % bs  # the round whose append starts its next block
            if first < num_rounds:
                takes = range(2 * first * m + i, span, stride)
                num_takes += len(takes)
                events.extend(takes)
            if publish_full_blocks and (full := -(n + 1) % bs) < num_rounds:  # the round that fills it
                events.extend(range((2 * full + 1) * m + i, span, stride))
        if num_takes > self._free.length + self._cached.length:
            raise OutOfBlocksError(f"{num_rounds} rounds of appends to {m} sequences need {num_takes} new "
                                   f"blocks but only {self._free.length + self._cached.length} are free")
        if not num_rounds or not m:
            return
        if any(seq.auto_publish for seq in seqs) and (self.enable_prefix_caching or publish_full_blocks):
            self._rounds_one_by_one(ids, seqs, token_id, num_rounds, publish_full_blocks)
            return
        lengths = [len(seq.token_ids) for seq in seqs]
        fill = [token_id] * num_rounds
        for seq in seqs:  # every token first: a publication reads them, a take does not
            seq.token_ids.extend(fill)
        events.sort()
        take, caching = self._take_fresh, self.enable_prefix_caching
        for e in events:
            kind_round, i = divmod(e, m)
            seq = seqs[i]
            if not kind_round & 1:
                seq.blocks.append(take())
                continue
            upto = lengths[i] + (kind_round >> 1) + 1  # publish_blocks(seq, upto)
            if upto > seq.num_computed:
                seq.num_computed = upto
            if caching:
                self._publish(seq, upto // bs)
        for seq, n in zip(seqs, lengths):
            if seq.auto_publish and seq.num_computed == n:  # no prefix cache here: nothing to publish
                seq.num_computed = n + num_rounds
        self._table_blocks += num_takes
        self._live_tokens += m * num_rounds

    def append_token_runs(self, seq_ids: Iterable[Hashable], counts: Iterable[int], token_id: int) -> None:
        """``counts[i]`` calls ``append_token(seq_ids[i], token_id)``, pair after pair, in one call: the
        same blocks taken in the same order and the same state and statistics, for a caller that knows
        no copy-on-write is due. A sequence may come back in a later pair. The serving simulator tells
        each sequence its decode steps' tokens late, in a pair that ends with the token starting a new
        block, so that its takes keep their places among the other sequences' takes and frees; the
        cost is one pass over the pairs plus one per block taken.

        Raises, changing nothing: InvalidArgumentError for counts that are not ints >= 0 (or not one per
        sequence) or when a sequence's partial last block is shared (a copy-on-write is due), and
        OutOfBlocksError when the blocks every pair needs are not all free.
        """
        token_id = _checked_token(token_id)
        ids, cs = list(seq_ids), list(counts)
        if len(ids) != len(cs):
            raise InvalidArgumentError(f"counts must give one count per sequence: {len(cs)} counts for {len(ids)} "
                                       "sequences")
        if cs and (set(map(type, cs)) != {int} or min(cs) < 0):  # at C speed
            bad = next(c for c in cs if type(c) is not int or c < 0)
            raise InvalidArgumentError(f"counts must be ints >= 0, got {bad!r}")
        seqs = self._sequences_of(ids)
        bs = self._block_size
        for seq in seqs:  # a table's late tokens are all one token: another one's are written first
            if seq.num_late and seq.late_token != token_id:
                seq.settle_late_tokens()
        # one pass: each pair's tokens counted late (a sequence's later pairs start where its earlier ones
        # end) and its takes counted; undone if a check fails
        lengths, takes = [], []
        forked = self._forks  # only a fork shares a partial block (a prefix hit is a full one, never the last)
        for seq, c in zip(seqs, cs):
            n = seq.num_tokens
            # (a sequence's later pair past its last block writes into one it takes: nothing shared)
            if forked and n % bs and seq.blocks[-1].ref_count != 1 and -(-n // bs) == len(seq.blocks):
                self._undo_runs(seqs, lengths)
                sid = ids[len(lengths)]
                raise InvalidArgumentError(f"sequence {sid!r} shares its last block {seq.blocks[-1].block_id}: "
                                           "a copy-on-write is due, append one token at a time")
            lengths.append(n)
            takes.append((n + c - 1) // bs - (n - 1) // bs)  # blocks for tokens [n, n + c) (n >= 1)
            seq.num_late += c
            seq.late_token = token_id
        num_takes = sum(takes)
        if num_takes > self._free.length + self._cached.length:
            self._undo_runs(seqs, lengths)
            raise OutOfBlocksError(f"{sum(cs)} appends to {len(set(ids))} sequences need {num_takes} new blocks "
                                   f"but only {self._free.length + self._cached.length} are free")
        if self.enable_prefix_caching and any(seq.auto_publish for seq in seqs):  # blocks cached as they fill
            self._undo_runs(seqs, lengths)
            for sid, c in zip(ids, cs):
                for _ in range(c):
                    self.append_token(sid, token_id)
            return
        taken = self._take_fresh_many(num_takes) if num_takes else ()  # in the pairs' order, as their calls take them
        i = 0
        for seq, c, t, n in zip(seqs, cs, takes, lengths):
            if t:
                if t == 1:
                    seq.blocks.append(taken[i])
                else:
                    seq.blocks += taken[i:i + t]
                i += t
            if seq.auto_publish and seq.num_computed == n:  # no prefix cache here: nothing to publish
                seq.num_computed = n + c
        self._table_blocks += num_takes
        self._live_tokens += sum(cs)

    def append_token_takes(self, seq_ids: Iterable[Hashable], token_id: int) -> None:
        """For each of ``seq_ids`` in order, ``append_token(seq_id, token_id)`` calls up to and including the
        first that takes a block (``-n % block_size + 1`` of them for a table of ``n`` tokens): one block per
        id, in the ids' order, the same state and statistics, for a caller that knows no copy-on-write is
        due. A sequence may come back (its next block). The serving simulator's decode session tells each
        running sequence its tokens late, up to the one that starts its next block, in the order the steps
        take those blocks: it knows the order, and the counts follow from the tables.

        Raises, changing nothing: InvalidArgumentError when a sequence's partial last block is shared (a
        copy-on-write is due), OutOfBlocksError when fewer blocks than ids are free.
        """
        token_id = _checked_token(token_id)
        ids = list(seq_ids)
        seqs = self._sequences_of(ids)
        bs = self._block_size
        if self._forks:  # only a fork shares a partial block (a prefix hit is a full one, never the last)
            for sid, seq in zip(ids, seqs):  # (a sequence's later ids find the block its first one took)
                if seq.num_tokens % bs and seq.blocks[-1].ref_count != 1:
                    raise InvalidArgumentError(f"sequence {sid!r} shares its last block {seq.blocks[-1].block_id}: "
                                               "a copy-on-write is due, append one token at a time")
        num = len(ids)
        if num > self._free.length + self._cached.length:
            raise OutOfBlocksError(f"{num} appends up to a new block need {num} new blocks but only "
                                   f"{self._free.length + self._cached.length} are free")
        if self.enable_prefix_caching and any(seq.auto_publish for seq in seqs):  # blocks cached as they fill
            for sid, seq in zip(ids, seqs):
                for _ in range(-seq.num_tokens % bs + 1):
                    self.append_token(sid, token_id)
            return
        live = 0
        for seq, block in zip(seqs, self._take_fresh_many(num)):
            late = seq.num_late
            if late and seq.late_token != token_id:  # a table's late tokens are all one token
                seq.settle_late_tokens()
                late = 0
            n = len(seq.token_ids) + late
            c = -n % bs + 1  # its tokens up to the one that starts its next block, told late
            seq.num_late = late + c
            seq.late_token = token_id
            seq.blocks.append(block)
            if seq.auto_publish and seq.num_computed == n:  # no prefix cache here: nothing to publish
                seq.num_computed = n + c
            live += c
        self._table_blocks += num
        self._live_tokens += live

    def _sequences_of(self, ids: list) -> list:
        try:
            return [self._seqs[s] for s in ids]
        except (KeyError, TypeError):
            return [self._get(s) for s in ids]  # raises the error that names the problem

    @staticmethod
    def _undo_runs(seqs: list, lengths: list[int]) -> None:
        """Give the first ``len(lengths)`` pairs' sequences back the late tokens they had (a sequence's first
        pair found the fewest: it is undone last)."""
        for seq, n in reversed(list(zip(seqs, lengths))):
            seq.num_late = n - len(seq.token_ids)

    def _rounds_one_by_one(self, ids: list, seqs: list, token_id: int, num_rounds: int,
                           publish_full_blocks: bool) -> None:
        """The rounds of :meth:`append_token_rounds` as calls, for sequences that publish as they append
        (a block that fills enters the cache between other sequences' takes, which may evict); each call
        now succeeds."""
        bs = self._block_size
        for _ in range(num_rounds):
            for s in ids:
                self.append_token(s, token_id)
            if publish_full_blocks:
                for s, seq in zip(ids, seqs):
                    if len(seq.token_ids) % bs == 0:
                        self.publish_blocks(s, len(seq.token_ids))


def _checked_token(token_id: object) -> int:
    """``token_id`` as a plain int; a plain int in range passes at once, anything else goes through the block
    manager's one check of a token id (which names the problem)."""
    if type(token_id) is int and 0 <= token_id < _MAX_TOKEN:
        return token_id
    return checked_token_id(token_id)
