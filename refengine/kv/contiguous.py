"""The contiguous (Orca-style) baselines: per-request reservations placed in one linear arena.

Each request reserves, at admission, one *consecutive* run of blocks big enough for its whole
reservation; it grows into it and gives it back when it leaves. The reservation policy decides how
much (the vLLM paper's Orca baselines, §6.1):

=========  ===============================================================
``max``    ``max_seq_len`` slots, whatever the request (Orca (Max))
``pow2``   prompt + the next power of two >= the true output length, capped at
           ``max_seq_len`` (an output of 25 reserves 32: Orca (Pow2))
``oracle`` exactly prompt + output (Orca (Oracle), knows the future)
=========  ===============================================================

:class:`ContiguousBlockManager` speaks :class:`refengine.BlockManager`'s accounting interface, so the
engine's scheduler can drive either (``allocator="contiguous"``). Every block of a reservation has ref
count 1 (nothing is shared: no prefix caching, no fork), ``append_token`` never copies, and appending
past the reservation raises :class:`~refengine.errors.OutOfBlocksError`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedbench.refengine.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidRequestError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from pagedbench.refengine.kv.arena import make_allocator

POLICIES = ("max", "pow2", "oracle")


class ForkNotSupportedError(InvalidRequestError, NotImplementedError):
    """Contiguous reservations cannot share blocks, so parallel sampling (fork) is not available."""


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``): 25 -> 32, 32 -> 32, 1 -> 1."""
    return 1 << (_count("n", n, 1) - 1).bit_length()


def reservation(policy: str, prompt_len: int, output_len: int, max_seq_len: int) -> int:
    """Slots a request reserves under ``policy`` (see the module docstring)."""
    if policy not in POLICIES:
        raise InvalidArgumentError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    prompt_len = _count("prompt_len", prompt_len, 1)
    output_len = _count("output_len", output_len, 1)
    max_seq_len = _count("max_seq_len", max_seq_len, 1)
    if prompt_len + output_len > max_seq_len:
        raise InvalidArgumentError(
            f"prompt_len + output_len = {prompt_len} + {output_len} exceeds max_seq_len {max_seq_len}")
    if policy == "max":
        return max_seq_len
    if policy == "pow2":
        return min(prompt_len + next_power_of_two(output_len), max_seq_len)
    return prompt_len + output_len


@dataclass(frozen=True, slots=True)
class ContiguousMetrics:
    """A snapshot of a :class:`ContiguousBlockManager`'s accounting (slots = blocks x block_size)."""

    num_blocks: int  # blocks in the arena
    block_size: int  # slots per block
    num_sequences: int  # live reservations
    num_used_blocks: int  # blocks held by reservations, buddy rounding included
    num_free_blocks: int  # blocks in holes
    largest_free_blocks: int  # the largest hole (what the next reservation can get)
    num_tokens: int  # token states held (sum over live sequences)
    reserved_slots: int  # slots of the requested runs, ceil(reservation / block_size) * block_size each
    rounding_waste_slots: int  # buddy rounding: held minus requested (0 for first fit)
    internal_fragmentation_slots: int  # held slots minus token states
    failed_allocations: int  # allocate calls refused for lack of a fitting hole (counter)


class _Reservation:
    __slots__ = ("num_reserved_blocks", "num_tokens", "reserve_tokens", "start")

    def __init__(self, start: int, num_reserved_blocks: int, reserve_tokens: int, num_tokens: int) -> None:
        self.start = start  # first block id of the consecutive run
        self.num_reserved_blocks = num_reserved_blocks  # ceil(reserve_tokens / block_size)
        self.reserve_tokens = reserve_tokens  # the sequence may grow to this many tokens
        self.num_tokens = num_tokens  # tokens held now


class ContiguousBlockManager:
    """Contiguous reservations of ``ceil(reservation / block_size)`` consecutive blocks in one arena.

    ``placement`` is ``"buddy"`` (:class:`~refengine.arena.BuddyAllocator`, as the paper's Orca) or
    ``"first_fit"``. Block ids are arena offsets; a sequence's block table is the consecutive run
    ``start .. start + ceil(num_tokens / block_size) - 1``.
    """

    def __init__(self, num_blocks: int, block_size: int, *, max_seq_len: int, policy: str = "max",
                 placement: str = "buddy") -> None:
        self.num_blocks = _count("num_blocks", num_blocks, 1)
        self.block_size = _count("block_size", block_size, 1)
        self.max_seq_len = _count("max_seq_len", max_seq_len, 1)
        if policy not in POLICIES:
            raise InvalidArgumentError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.policy = policy
        self.placement = placement
        self._arena = make_allocator(placement, self.num_blocks)
        self._seqs: dict[Hashable, _Reservation] = {}
        self._owner: dict[int, Hashable] = {}  # start block -> seq id
        self._failed_allocations = 0
        self._live_tokens = 0  # sum of every reservation's num_tokens, kept as they change
        self._table_blocks = 0  # sum of every table's length (its tokens' blocks), kept the same way

    @property
    def reserves_by_output_len(self) -> bool:
        """Whether :meth:`allocate` needs ``output_len`` (the pow2 and oracle policies)."""
        return self.policy != "max"

    # --- reservations ---------------------------------------------------------------------------
    def _reserve_tokens(self, num_tokens: int, output_len: int | None, reserve_tokens: int | None) -> int:
        if reserve_tokens is not None:
            r = _count("reserve_tokens", reserve_tokens, 1)
            if not num_tokens <= r <= self.max_seq_len:
                raise InvalidArgumentError(
                    f"reserve_tokens must be in [{num_tokens} (the prompt), {self.max_seq_len} "
                    f"(max_seq_len)], got {r}")
            return r
        if num_tokens > self.max_seq_len:
            raise InvalidArgumentError(
                f"prompt of {num_tokens} tokens exceeds max_seq_len {self.max_seq_len}")
        if self.policy == "max":
            return self.max_seq_len
        if output_len is None:
            raise InvalidArgumentError(
                f"policy {self.policy!r} needs the request's output length: "
                "pass output_len= (or reserve_tokens=)")
        return reservation(self.policy, num_tokens, output_len, self.max_seq_len)

    def can_allocate(self, num_tokens: int, *, output_len: int | None = None,
                     reserve_tokens: int | None = None) -> bool:
        """Whether a prompt of ``num_tokens`` tokens (reserving as :meth:`allocate` would) fits now."""
        r = self._reserve_tokens(_count("num_tokens", num_tokens, 1), output_len, reserve_tokens)
        return self._arena.can_allocate(math.ceil(r / self.block_size))

    def can_ever_allocate(self, num_tokens: int, *, output_len: int | None = None,
                          reserve_tokens: int | None = None) -> bool:
        """Whether such a prompt's reservation fits the empty arena: its footprint within the largest
        allocation the placement can ever make (the largest buddy tree; the whole arena first fit)."""
        return self.footprint_blocks(num_tokens, output_len=output_len,
                                     reserve_tokens=reserve_tokens) <= self._arena.max_allocation

    def footprint_blocks(self, num_tokens: int, *, output_len: int | None = None,
                         reserve_tokens: int | None = None) -> int:
        """Blocks the arena would take for such a prompt's reservation, the buddy's rounding included."""
        r = self._reserve_tokens(_count("num_tokens", num_tokens, 1), output_len, reserve_tokens)
        return self._arena.footprint(math.ceil(r / self.block_size))

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, cache_salt: str | None = None,
                 reserve_tokens: int | None = None, output_len: int | None = None,
                 publish: bool = True) -> int:
        """Reserve a consecutive run for a prompt; returns 0 (no prefix cache here).

        ``reserve_tokens`` overrides the policy with an explicit reservation (in tokens); ``output_len``
        is the true output length the ``pow2`` and ``oracle`` policies need. ``cache_salt`` and
        ``publish`` are accepted for interface parity and have no effect. Raises OutOfBlocksError (and
        takes nothing) when no hole holds the reservation.
        """
        if seq_id is None:
            raise InvalidArgumentError("seq_id must not be None")
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")
        tokens = list(token_ids)
        if not tokens:
            raise InvalidArgumentError("token_ids must not be empty")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidArgumentError(f"token ids must be non-negative ints, got {t!r}")
        r = self._reserve_tokens(len(tokens), output_len, reserve_tokens)
        n_blocks = math.ceil(r / self.block_size)
        start = self._arena.allocate(n_blocks)
        if start is None:
            self._failed_allocations += 1
            raise OutOfBlocksError(
                f"no hole of {n_blocks} consecutive blocks for {seq_id!r} ({r} tokens reserved, policy "
                f"{self.policy!r}); {self.num_free_blocks} blocks free, largest hole "
                f"{self._arena.largest_free()}")
        self._seqs[seq_id] = _Reservation(start, n_blocks, r, len(tokens))
        self._owner[start] = seq_id
        self._live_tokens += len(tokens)
        self._table_blocks += -(-len(tokens) // self.block_size)
        return 0

    def append_token(self, seq_id: Hashable, token_id: int) -> list[tuple[int, int]]:
        """Room for one more token inside the reservation; returns [] (never a copy)."""
        res = self._get(seq_id)
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise InvalidArgumentError(f"token id must be a non-negative int, got {token_id!r}")
        if res.num_tokens >= res.reserve_tokens:
            raise OutOfBlocksError(
                f"sequence {seq_id!r} has used its whole reservation of {res.reserve_tokens} tokens")
        if res.num_tokens % self.block_size == 0:  # the token starts a block of the table
            self._table_blocks += 1
        res.num_tokens += 1
        self._live_tokens += 1
        return []

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Room for several tokens inside the reservation, as one ``append_token`` call per token would
        leave it; raises OutOfBlocksError (nothing changed) when they do not all fit."""
        res = self._get(seq_id)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in token_ids):
            raise InvalidArgumentError("token ids must be non-negative ints")
        m = len(token_ids)
        if res.num_tokens + m > res.reserve_tokens:
            raise OutOfBlocksError(f"sequence {seq_id!r} has room for {res.reserve_tokens - res.num_tokens} more "
                                   f"tokens in its reservation of {res.reserve_tokens}, not {m}")
        bs = self.block_size
        self._table_blocks += -(-(res.num_tokens + m) // bs) - -(-res.num_tokens // bs)
        res.num_tokens += m
        self._live_tokens += m

    def record_refused_allocations(self, count: int) -> None:
        """Count ``count`` refused ``allocate`` calls without making them: a simulator that skips steps
        whose allocation it has shown would be refused keeps the statistics of the calls it skipped."""
        if type(count) is not int or count < 0:
            raise InvalidArgumentError(f"count must be an int >= 0, got {count!r}")
        self._failed_allocations += count

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether :meth:`append_token` would succeed (the reservation has room)."""
        res = self._get(seq_id)
        return res.num_tokens < res.reserve_tokens

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        raise ForkNotSupportedError(
            "ContiguousBlockManager does not support fork: contiguous reservations cannot share blocks "
            "(use refengine.BlockManager for parallel sampling)")

    def free(self, seq_id: Hashable) -> None:
        res = self._get(seq_id)
        self._arena.free(res.start)
        del self._owner[res.start]
        del self._seqs[seq_id]
        self._live_tokens -= res.num_tokens
        self._table_blocks -= -(-res.num_tokens // self.block_size)

    # --- queries --------------------------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> _Reservation:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}") from None

    def has_sequence(self, seq_id: Hashable) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The consecutive block ids covering the tokens so far."""
        res = self._get(seq_id)
        return list(range(res.start, res.start + math.ceil(res.num_tokens / self.block_size)))

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_tokens

    def reserved_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence may grow to (its reservation)."""
        return self._get(seq_id).reserve_tokens

    def held_blocks(self, seq_id: Hashable) -> int:
        """Blocks the arena holds for the sequence (its run plus the buddy's rounding)."""
        return self._arena.allocation(self._get(seq_id).start)[0]

    def slot(self, seq_id: Hashable, position: int) -> int:
        res = self._get(seq_id)
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < res.num_tokens:
            raise InvalidArgumentError(f"position must be in [0, {res.num_tokens}), got {position!r}")
        return res.start * self.block_size + position

    def ref_count(self, block_id: int) -> int:
        """1 when the block is inside a live reservation (its requested run), else 0."""
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise InvalidArgumentError(f"block id must be in [0, {self.num_blocks}), got {block_id!r}")
        for res in self._seqs.values():
            if res.start <= block_id < res.start + res.num_reserved_blocks:
                return 1
        return 0

    @property
    def num_free_blocks(self) -> int:
        return self._arena.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._arena.num_free

    @property
    def num_cached_blocks(self) -> int:
        return 0

    @property
    def num_live_tokens(self) -> int:
        """Token states held (``metrics().num_tokens``, O(1))."""
        return self._live_tokens

    @property
    def num_table_blocks(self) -> int:
        """Entries of every block table together (the blocks its tokens cover, not the reservation; O(1))."""
        return self._table_blocks

    def metrics(self) -> ContiguousMetrics:
        bs = self.block_size
        tokens = sum(r.num_tokens for r in self._seqs.values())
        rounding = self._arena.rounding_waste * bs
        reserved = sum(r.num_reserved_blocks for r in self._seqs.values()) * bs
        return ContiguousMetrics(
            num_blocks=self.num_blocks, block_size=bs, num_sequences=len(self._seqs),
            num_used_blocks=self.num_used_blocks, num_free_blocks=self.num_free_blocks,
            largest_free_blocks=self._arena.largest_free(), num_tokens=tokens, reserved_slots=reserved,
            rounding_waste_slots=rounding, internal_fragmentation_slots=reserved + rounding - tokens,
            failed_allocations=self._failed_allocations)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the broken invariant."""
        self._arena.check_invariants()
        used = 0
        for seq_id, res in self._seqs.items():
            held, requested = self._arena.allocation(res.start)
            if requested != res.num_reserved_blocks:
                raise AssertionError(f"{seq_id!r}: arena holds {requested} blocks, reservation says "
                                     f"{res.num_reserved_blocks}")
            if not 1 <= res.num_tokens <= res.reserve_tokens <= res.num_reserved_blocks * self.block_size:
                raise AssertionError(f"{seq_id!r}: tokens {res.num_tokens} outside its reservation "
                                     f"{res.reserve_tokens} ({res.num_reserved_blocks} blocks)")
            if self._owner.get(res.start) != seq_id:
                raise AssertionError(f"{seq_id!r}: owner index out of sync at block {res.start}")
            used += held
        if used != self.num_used_blocks or len(self._owner) != len(self._seqs):
            raise AssertionError(f"held blocks {used} != arena's used blocks {self.num_used_blocks}")
        if self._live_tokens != sum(r.num_tokens for r in self._seqs.values()):
            raise AssertionError(f"live token count {self._live_tokens} != the reservations' tokens")
        entries = sum(-(-r.num_tokens // self.block_size) for r in self._seqs.values())
        if self._table_blocks != entries:
            raise AssertionError(f"table block count {self._table_blocks} != the tables' {entries} entries")
