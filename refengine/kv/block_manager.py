"""The block manager: block tables, reference counts, copy-on-write and the prefix cache.

Each sequence owns a *block table*: the physical block ids holding its tokens in logical order, so
token ``pos`` lives in slot ``block_table[pos // block_size] * block_size + pos % block_size``::

    seq "a", 7 tokens, block_size 4      block table [5, 2]
    logical block 0: tokens 0-3  ->  physical block 5, slots 20..23
    logical block 1: tokens 4-6  ->  physical block 2, slots  8..10 (slot 11 free: internal fragmentation)

A block is shared by every table that holds it (``ref_count``). A shared block is never written: an
append into a shared, partial last block first moves the writer to a fresh block and reports the
``(src, dst)`` copy the caller must apply to the KV data (:meth:`TableGrowth._copy_on_write_last_block`,
the one copy-on-write hook; appends and copy-on-write live in :mod:`refengine.kv.table_growth`).

Prefix caching (``enable_prefix_caching=True``): a full block is *published* under a chained SHA-256
hash of (parent hash, its token ids), rooted at the request's ``cache_salt`` (:mod:`refengine.prefix_hash`).
A new prompt reuses the longest chain of published blocks whose tokens *and* parent verify (a hash
collision can never serve another prompt's KV), but never its last token: at most
``(len(prompt) - 1) // block_size`` blocks are hits, so a fully cached prompt still computes the last
block and with it the last token's logits (vLLM does the same). With ``allocate(..., publish=False)``
blocks enter the cache only through :meth:`publish_blocks`, once their KV is written (vLLM #7822), the
blocks that later fill through :meth:`append_token` included: a step that fails before its KV is
written leaves nothing in the cache. With the default ``publish=True`` (a caller writing KV as it goes)
a block filled by :meth:`append_token` is cached when it becomes full, if every earlier token is written.

Free blocks sit in two O(1) queues (:mod:`refengine.free_block_queue`): uncached blocks (a FIFO list,
taken and returned in batches), and *cached* blocks (published KV, no table holds them; an intrusive list,
so that a prefix hit takes one from the middle), which stay reusable by a prefix hit. A fresh
block is taken from the uncached queue first (FIFO); only when it is empty is the least recently freed
cached block evicted. A freed sequence's blocks are queued tail first, so a chain's tail is evicted
before its head. Every failed call raises before changing anything.

With a host tier (``num_host_blocks``), an evicted cached block's KV goes to host memory under its hash and
a prompt's lookup continues there where the device misses; such a block is loaded back into a fresh device
block rather than computed (:mod:`refengine.kv.prefix_offload`, :mod:`refengine.kv.host_tier`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import asdict, dataclass

from pagedbench.refengine.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from pagedbench.refengine.kv import prefix_hash
from pagedbench.refengine.kv.block_manager_checks import (
    BlockManagerMetrics,
    check_invariants,
    compute_metrics,
)
from pagedbench.refengine.kv.decode_rounds import DecodeRounds
from pagedbench.refengine.kv.free_block_queue import FifoBlockQueue, FreeBlockQueue, KVBlock
from pagedbench.refengine.kv.host_tier import HostPrefixTier
from pagedbench.refengine.kv.prefix_cache import PrefixCache
from pagedbench.refengine.kv.prefix_offload import PrefixOffload
from pagedbench.refengine.kv.swap_tables import SwapTables
from pagedbench.refengine.kv.table_growth import TableGrowth
from pagedbench.refengine.kv.token_checks import (
    checked_positive_int,
    checked_token_list,
)

__all__ = ["AllocationPreview", "BlockManager", "BlockManagerMetrics"]



class _Sequence:
    """One sequence's state (mutable, hot)."""

    __slots__ = ("auto_publish", "blocks", "chain_hash", "chain_key", "late_token", "num_computed", "num_late",
                 "num_published", "salt", "token_ids")

    def __init__(self, blocks: list[KVBlock], token_ids: list[int], salt: object, num_computed: int,
                 num_published: int, chain_hash: bytes | None, chain_key: object, auto_publish: bool) -> None:
        self.blocks = blocks  # the block table as block objects, logical order
        self.token_ids = token_ids  # every token of the sequence (prompt, then appended ones)
        self.salt = salt  # the request's cache_salt
        self.num_computed = num_computed  # tokens [0, num_computed) have their KV written (or this step)
        self.num_published = num_published  # blocks [0, num_published) were looked up or published
        self.chain_hash = chain_hash  # hash of block num_published - 1 (the salt's root hash at 0)
        self.chain_key = chain_key  # parent_key for the next published block; None: chain broken
        # True: an appended token counts as written at once (its block is cached when full). False
        # (allocated with publish=False): only publish_blocks marks KV written, after the step that
        # wrote it, so a step that fails never leaves a cached block without its KV.
        self.auto_publish = auto_publish
        # tokens told in bulk (append_token_takes and append_token_runs: a simulator's decode tokens told
        # late) and not yet written: ``num_late`` copies of ``late_token`` follow ``token_ids``. A count costs
        # nothing per token, and most such tables are freed unread; any other read writes them first
        # (settle_late_tokens)
        self.num_late = 0
        self.late_token = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_late

    def settle_late_tokens(self) -> None:
        """Write the late tokens into the list, for a reader other than the bulk appends."""
        self.token_ids += [self.late_token] * self.num_late
        self.num_late = 0


@dataclass(frozen=True, slots=True)
class AllocationPreview:
    """What :meth:`BlockManager.allocate` would do with a prompt now."""

    fits: bool  # the call would take the prompt (False: it would raise OutOfBlocksError)
    num_hit_blocks: int  # its leading blocks the prefix cache would serve (0 without prefix caching)


class BlockManager(TableGrowth, PrefixCache, DecodeRounds, SwapTables, PrefixOffload):
    """Block tables over a pool of ``num_blocks`` blocks of ``block_size`` token slots (module docstring).

    ``num_host_blocks`` > 0 (prefix caching only) adds the prefix cache's host tier: evicted cached blocks
    keep their KV in that many host blocks and prefix hits there are loaded back
    (:mod:`refengine.kv.prefix_offload`); its copies are read with :meth:`take_offload_copies`."""

    __slots__ = ("_block_size", "_blocks", "_cache", "_cached", "_copy_on_write_copies", "_evictions",
                 "_failed_allocations", "_forks", "_free", "_host", "_host_hit_tokens", "_live_tokens",
                 "_next_content_id", "_num_blocks", "_prefix_hit_tokens", "_prefix_query_tokens", "_seqs",
                 "_table_blocks", "_twins", "enable_prefix_caching")

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0) -> None:
        self._num_blocks = checked_positive_int("num_blocks", num_blocks)
        self._block_size = checked_positive_int("block_size", block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise InvalidArgumentError(f"num_host_blocks must be an int >= 0, got {num_host_blocks!r}")
        if num_host_blocks and not self.enable_prefix_caching:
            raise InvalidArgumentError(f"num_host_blocks={num_host_blocks} is a host tier of the prefix cache: "
                                       "it needs enable_prefix_caching=True")
        self._host = HostPrefixTier(num_host_blocks) if num_host_blocks else None
        self._host_hit_tokens = 0  # prompt tokens served from the host tier (loaded, not computed)
        self._blocks = [KVBlock(i) for i in range(self._num_blocks)]
        self._free = FifoBlockQueue(self._blocks)  # free blocks holding no cached KV, FIFO
        self._cached = FreeBlockQueue()  # free blocks holding published KV, LRU first (evictable)
        self._cache: dict[bytes, KVBlock] = {}  # block hash -> published block (in use or cached)
        # block hash -> other blocks holding the same KV (two requests with one prompt computed it twice);
        # cached too, so that the KV outlives the first copy's eviction; one of them takes the map's
        # place when the block there is evicted
        self._twins: dict[bytes, list[KVBlock]] = {}
        self._seqs: dict[Hashable, _Sequence] = {}
        self._next_content_id = 1
        self._prefix_query_tokens = 0  # prompt tokens looked up (successful allocations)
        self._prefix_hit_tokens = 0  # of those, tokens served from the cache
        self._evictions = 0  # cached blocks evicted to make room
        self._copy_on_write_copies = 0  # (src, dst) copies reported
        self._forks = 0  # successful fork() calls
        self._failed_allocations = 0  # allocate() calls rejected with OutOfBlocksError
        # token states held, a shared block's once: kept as blocks are taken and released, so the
        # engine can read utilisation every step without a pass over every table
        self._live_tokens = 0
        self._table_blocks = 0  # entries of every table together (kept the same way)

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds, including cached blocks that can be evicted."""
        return self._free.length + self._cached.length

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one block table."""
        return self._num_blocks - self._free.length - self._cached.length

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks holding published KV (reusable by a prefix hit, evicted when room is needed)."""
        return len(self._cached)

    @property
    def num_live_tokens(self) -> int:
        """Token states held by the tables, a token in a shared block once (``metrics().live_tokens``, O(1))."""
        return self._live_tokens

    @property
    def num_table_blocks(self) -> int:
        """Entries of every block table together, a block shared by k tables k times (O(1))."""
        return self._table_blocks

    # --- the contract ----------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids: Iterable[int], *, cache_salt: str | bytes | None = None,
                 publish: bool = True, reserve_free_blocks: int = 0, check_tokens: bool = True) -> int:
        """Give a new sequence blocks for its prompt; return the number of tokens served from the cache.

        The returned count is a multiple of ``block_size`` and at most ``len(token_ids) - 1``. With
        ``publish=False`` no block of the sequence is cached (prompt or later tokens) until
        :meth:`publish_blocks` says its KV is written. Prefix hits count: only the blocks the prompt
        must take are needed. Raises OutOfBlocksError (nothing taken) when those blocks are not free,
        or when taking them would leave fewer than ``reserve_free_blocks`` free (a watermark).

        ``check_tokens=False``: the caller vouches that ``token_ids``, a non-empty list, holds plain ints in
        ``[0, 2**63)`` (a scheduler admitting a sequence whose prompt was checked where it entered the
        engine, or one preempted, whose tokens this manager accepted before); the list is copied, not
        read item by item.
        """
        self._check_new_seq_id(seq_id)
        if check_tokens is True:
            tokens = self._checked_prompt(token_ids, cache_salt, reserve_free_blocks)
        else:
            tokens = self._vouched_prompt(token_ids, cache_salt, reserve_free_blocks, check_tokens)
        bs = self._block_size
        hits, chain_hash, chain_key, num_fresh, available = self._admission(tokens, cache_salt)
        if not _fits(num_fresh, reserve_free_blocks, available):
            self._failed_allocations += 1
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {num_fresh} free blocks ({len(tokens)} tokens, "
                f"{len(hits)} cached blocks reused)"
                + (f" and {reserve_free_blocks} kept free," if reserve_free_blocks else "")
                + f" but only {available} are free")
        num_loaded = 0
        if self._host is None or not hits:
            revived = 0  # cached hits no table held: their tokens become live again
            for b in hits:
                if b.ref_count == 0:
                    self._cached.remove(b)
                    revived += 1
                b.ref_count += 1
            blocks = hits + self._take_fresh_many(num_fresh)
        else:
            blocks, revived, num_loaded = self._take_tier_hits(hits, num_fresh)
        self._live_tokens += len(tokens) - (len(hits) - revived) * bs
        self._table_blocks += len(blocks)
        num_computed = len(tokens) if publish else len(hits) * bs
        seq = _Sequence(blocks, tokens, cache_salt, num_computed, len(hits), chain_hash, chain_key, publish)
        self._seqs[seq_id] = seq
        if self.enable_prefix_caching:
            self._prefix_query_tokens += len(tokens)
            self._prefix_hit_tokens += (len(hits) - num_loaded) * bs
            self._host_hit_tokens += num_loaded * bs
            if publish:
                self._publish(seq, len(tokens) // bs)
        return len(hits) * bs

    def allocation_preview(self, token_ids: Iterable[int], *, cache_salt: str | bytes | None = None,
                           reserve_free_blocks: int = 0) -> AllocationPreview:
        """What :meth:`allocate` would do with this prompt now (prefix hits counted), changing nothing:
        for a caller that must know a prompt is refused without counting a refused call (the serving
        simulator, before it skips steps that would each be refused). Bad arguments raise as in allocate."""
        tokens = self._checked_prompt(token_ids, cache_salt, reserve_free_blocks)
        hits, _, _, num_fresh, available = self._admission(tokens, cache_salt)
        return AllocationPreview(_fits(num_fresh, reserve_free_blocks, available), len(hits))

    def record_refused_allocations(self, count: int) -> None:
        """Count ``count`` refused ``allocate`` calls without making them: a simulator that skips steps
        whose allocation it has shown would be refused keeps the statistics of the calls it skipped."""
        if type(count) is not int or count < 0:
            raise InvalidArgumentError(f"count must be an int >= 0, got {count!r}")
        self._failed_allocations += count

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (parallel sampling)."""
        parent = self._get(parent_id)
        self._check_new_seq_id(child_id)
        for b in parent.blocks:
            b.ref_count += 1
        self._table_blocks += len(parent.blocks)
        self._seqs[child_id] = _Sequence(list(parent.blocks), list(parent.token_ids), parent.salt,
                                         parent.num_computed, parent.num_published, parent.chain_hash,
                                         parent.chain_key, parent.auto_publish)
        self._forks += 1

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks; published ones stay cached (tail first in the eviction order)."""
        self._lookup_seq(seq_id)  # (its late tokens are not written: they go with it)
        seq = self._seqs.pop(seq_id)
        blocks, bs = seq.blocks, self._block_size
        self._table_blocks -= len(blocks)
        if not self._forks and not self.enable_prefix_caching:  # every block its own, none cached: all go
            self._free.extend(blocks[::-1], release=True)
            self._live_tokens -= seq.num_tokens
            return
        released, cached = [], []  # tail first, each into its queue in one pass
        for b in reversed(blocks):
            b.ref_count -= 1
            if b.ref_count == 0:
                (released if b.block_hash is None else cached).append(b)
        num = len(released) + len(cached)
        if num:  # a block's tokens go with its last table (the last block holds the partial rest)
            last_tokens = bs if blocks[-1].ref_count else seq.num_tokens - (len(blocks) - 1) * bs
            self._live_tokens -= (num - 1) * bs + last_tokens
            self._free.extend(released)
            if cached:
                self._cached.extend(cached)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of the sequence, in logical order (a new list)."""
        return [b.block_id for b in self._get(seq_id).blocks]

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._lookup_seq(seq_id).num_tokens

    def token_ids(self, seq_id: Hashable) -> list[int]:
        """Every token of the sequence (a copy)."""
        return list(self._get(seq_id).token_ids)

    def slot(self, seq_id: Hashable, position: int) -> int:
        """The KV slot of token ``position``: ``block_table[pos // bs] * bs + pos % bs``."""
        seq = self._get(seq_id)
        n = len(seq.token_ids)
        if type(position) is not int or not 0 <= position < n:
            raise InvalidArgumentError(f"position must be an int in [0, {n}) for sequence {seq_id!r}, "
                                       f"got {position!r}")
        bs = self._block_size
        return seq.blocks[position // bs].block_id * bs + position % bs

    def can_allocate(self, num_tokens: int, *, reserve_free_blocks: int = 0) -> bool:
        """Whether a prompt of ``num_tokens`` tokens fits in the free blocks (ignoring prefix hits), leaving
        ``reserve_free_blocks`` free as :meth:`allocate`'s watermark does (without a prefix cache: exactly
        whether ``allocate`` would take it, at O(1) where ``allocate`` reads the whole prompt)."""
        if type(num_tokens) is not int or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if type(reserve_free_blocks) is not int or reserve_free_blocks < 0:
            raise InvalidArgumentError(f"reserve_free_blocks must be an int >= 0, got {reserve_free_blocks!r}")
        return -(-num_tokens // self._block_size) + reserve_free_blocks <= self._free.length + self._cached.length

    def can_ever_allocate(self, num_tokens: int, *, reserve_free_blocks: int = 0) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits the whole pool with every block free, leaving
        ``reserve_free_blocks``: False means no amount of waiting makes :meth:`can_allocate` true, so a
        caller refuses such a request at once and queues every other."""
        if type(num_tokens) is not int or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if type(reserve_free_blocks) is not int or reserve_free_blocks < 0:
            raise InvalidArgumentError(f"reserve_free_blocks must be an int >= 0, got {reserve_free_blocks!r}")
        return -(-num_tokens // self._block_size) + reserve_free_blocks <= self._num_blocks

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether :meth:`append_token` would succeed now (False: it needs a block and none is free)."""
        seq = self._get(seq_id)
        needs_block = len(seq.token_ids) % self._block_size == 0 or seq.blocks[-1].ref_count > 1
        return not needs_block or bool(self._free) or bool(self._cached)

    def ref_count(self, block_id: int) -> int:
        if type(block_id) is not int or not 0 <= block_id < self._num_blocks:
            raise InvalidArgumentError(
                f"block_id must be an int in [0, {self._num_blocks}), got {block_id!r}")
        return self._blocks[block_id].ref_count

    def has_sequence(self, seq_id: Hashable) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order fresh blocks are taken: uncached FIFO, then cached LRU first."""
        return self._free.block_ids() + self._cached.block_ids()

    def metrics(self) -> BlockManagerMetrics:
        return compute_metrics(self)

    def metrics_dict(self) -> dict[str, int]:
        return asdict(self.metrics())

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (see refengine.block_manager_checks)."""
        check_invariants(self)

    def __repr__(self) -> str:
        return (f"BlockManager(num_blocks={self._num_blocks}, block_size={self._block_size}, "
                f"prefix_caching={self.enable_prefix_caching}, sequences={len(self._seqs)}, "
                f"free={self.num_free_blocks}, cached={len(self._cached)}"
                + (f", host_blocks={self._host.num_blocks}, host_cached={len(self._host)})" if self._host else ")"))

    # --- internals -------------------------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> _Sequence:
        """The sequence, its late tokens written (for a reader of its tokens or a writer of new ones)."""
        seq = self._lookup_seq(seq_id)
        if seq.num_late:
            seq.settle_late_tokens()
        return seq

    def _lookup_seq(self, seq_id: Hashable) -> _Sequence:
        """The sequence as it is (late tokens counted, not written)."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(
                f"unknown sequence {seq_id!r} (never allocated, or already freed)") from None
        except TypeError:
            raise InvalidArgumentError(f"seq_id must be hashable, got {type(seq_id).__name__}") from None

    def _check_new_seq_id(self, seq_id: Hashable) -> None:
        if seq_id is None:
            raise InvalidArgumentError("seq_id must not be None")
        try:
            exists = seq_id in self._seqs
        except TypeError:
            raise InvalidArgumentError(f"seq_id must be hashable, got {type(seq_id).__name__}") from None
        if exists:
            raise DuplicateSequenceError(f"sequence {seq_id!r} is already allocated")

    def _checked_prompt(self, token_ids: Iterable[int], cache_salt: object, reserve_free_blocks: object) -> list[int]:
        """A prompt as a new list of ints, after allocate's checks of its arguments."""
        self._check_prompt_options(cache_salt, reserve_free_blocks)
        return checked_token_list(token_ids)

    def _vouched_prompt(self, token_ids: object, cache_salt: object, reserve_free_blocks: object,
                        check_tokens: object) -> list[int]:
        """A prompt whose ids the caller vouches for (``check_tokens=False``) as a new list, after the checks
        that read no id."""
        if check_tokens is not False:
            raise InvalidArgumentError(f"check_tokens must be a bool, got {check_tokens!r}")
        self._check_prompt_options(cache_salt, reserve_free_blocks)
        if type(token_ids) is not list or not token_ids:
            raise InvalidArgumentError("with check_tokens=False, token_ids must be a non-empty list, got "
                                       + ("an empty one" if type(token_ids) is list else type(token_ids).__name__))
        return token_ids.copy()

    @staticmethod
    def _check_prompt_options(cache_salt: object, reserve_free_blocks: object) -> None:
        if type(reserve_free_blocks) is not int or reserve_free_blocks < 0:
            raise InvalidArgumentError(f"reserve_free_blocks must be an int >= 0, got {reserve_free_blocks!r}")
        try:
            prefix_hash.salt_bytes(cache_salt)
        except TypeError as e:
            raise InvalidArgumentError(str(e)) from None

    def _admission(self, tokens: list[int], salt: object) -> tuple[list[KVBlock], bytes | None, object, int, int]:
        """A prompt's prefix hits (with the chain's hash and key after them), the fresh blocks it needs,
        and the blocks free for it (a cached hit no table holds is free, but not for another block)."""
        hits: list[KVBlock] = []
        chain_hash = chain_key = None
        if self.enable_prefix_caching:
            if self._host is None:
                hits, chain_hash, chain_key = self._lookup(tokens, salt)
            else:  # (hits on the host tier are HostEntry objects, each needing a fresh block)
                hits, chain_hash, chain_key = self._lookup_tiers(tokens, salt)
        num_fresh = -(-len(tokens) // self._block_size) - len(hits)
        available = self._free.length + self._cached.length
        if hits:
            if self._host is None:
                available -= sum(1 for b in hits if b.ref_count == 0)
            else:
                num_host, num_revived = self._tier_needs(hits)
                num_fresh += num_host
                available -= num_revived
        return hits, chain_hash, chain_key, num_fresh, available

    def _take_fresh_many(self, n: int) -> list[KVBlock]:
        """``n`` calls of :meth:`_take_fresh`: in one pass when the uncached queue covers them, else one at a
        time (evicting)."""
        try:
            return self._free.popleft_many(n)
        except IndexError:  # (it took none)
            return [self._take_fresh() for _ in range(n)]

    def _take_fresh(self) -> KVBlock:
        """A block for new KV (ref count 1): uncached first, else evict the LRU cached block (into the host
        tier, if there is one)."""
        if self._free:
            b = self._free.popleft()
        else:
            b = self._cached.popleft()
            if self._unmap(b) and self._host is not None:  # its hash left the device: the host keeps it
                self._host.store(b)
            b.clear_cache_entry()
            self._evictions += 1
        b.ref_count = 1
        return b


def _fits(num_fresh: int, reserve_free_blocks: int, available: int) -> bool:
    """allocate's test (one place, for allocate and allocation_preview alike)."""
    return num_fresh + reserve_free_blocks <= available
