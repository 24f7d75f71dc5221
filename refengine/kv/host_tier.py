"""The host tier of the prefix cache (vLLM's ``kv_offloading_size``): published blocks evicted from the
device keep their KV in host memory, keyed by their prefix hash, and a later prefix hit on the host tier
loads the block back instead of computing it again.

:class:`HostPrefixTier` is the bookkeeping only (no torch): which host block holds which hash, LRU
first, and the copies the step being planned needs. The KV itself lives in a
:class:`~pagedbench.refengine.kv.host_pool.HostBlockPool`; the executor applies the copies the scheduler
hands it (``SchedulerOutput.offload_store`` / ``offload_load``)::

    device tier (BlockManager._cache)          host tier (HostPrefixTier._entries)
    evict LRU cached block b  --- store --->   entry(hash of b) in host block x   (b's KV copied to x)
    prefix hit on the host    <--- load ----   entry e: a fresh device block d gets e's identity
                                               and e's KV (x copied to d)

Rules, each relied on by the block manager and the scheduler:

* the tier is *inclusive*: a loaded entry stays on the host (its KV never changes), so evicting the
  device copy again costs no copy (the entry is only moved to the MRU end);
* LRU: an entry moves to the MRU end when it is stored, loaded, or its hash is evicted from the device
  again; a store into a full tier evicts the least recently used entry that is not *pinned*;
* an entry stored or loaded in the step being planned is pinned until the step is committed or undone:
  the executor runs every store before any load, so a pinned entry's host block is never overwritten
  while the step reads it, and no host block is written twice in one step. A store that finds every
  entry pinned is dropped (the block's KV is simply lost, as without the tier: ``num_dropped_stores``);
* a failed step is undone (:meth:`undo_step`): the entries it stored are dropped (their copy may not
  have run) and the device blocks it loaded are returned for the block manager to unpublish.

Invariants (:meth:`check`): every host block id is free (once) or held by exactly one entry; the map's
keys are its entries' hashes; the hash of every entry is reproduced by its parent hash and tokens;
pinned entries are exactly the step's stored and loaded ones.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from pagedbench.refengine.kv import prefix_hash
from pagedbench.refengine.kv.free_block_queue import KVBlock


class HostEntry:
    """One host block holding a published block's KV (the identity fields are those of a KVBlock)."""

    __slots__ = ("block_hash", "content_id", "host_block_id", "parent_hash", "parent_key", "pinned", "token_ids")

    def __init__(self, host_block_id: int, b: KVBlock) -> None:
        self.host_block_id = host_block_id  # index into the host pool
        self.block_hash = b.block_hash  # the prefix-cache key (the map's key)
        self.parent_hash = b.parent_hash  # the chain hash the key was computed from (for checks)
        self.token_ids = b.token_ids  # the block's tokens, kept to verify every hit
        self.parent_key = b.parent_key  # content_id of the parent block, or ("root", salt)
        self.content_id = b.content_id  # the device publication's id: children chain off it
        self.pinned = True  # stored or loaded in the step in flight: never evicted until it ends

    def give_identity(self, b: KVBlock) -> None:
        """Publish device block ``b`` as this entry's content (its KV is loaded from the host)."""
        b.block_hash, b.parent_hash, b.token_ids = self.block_hash, self.parent_hash, self.token_ids
        b.parent_key, b.content_id = self.parent_key, self.content_id


class HostPrefixTier:
    """``num_blocks`` host blocks caching evicted prefix blocks by hash, LRU (module docstring)."""

    __slots__ = ("_entries", "_free", "_is_free", "_loaded", "_loading_ids", "_loads", "_pinned", "_stored",
                 "_stores", "num_blocks", "num_dropped_stores", "num_evictions", "num_loaded_blocks",
                 "num_stored_blocks")

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"a host tier needs an int >= 1 of blocks, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # hash -> entry, LRU first
        self._free: deque[int] = deque(range(num_blocks))  # host block ids no entry holds, FIFO
        self._is_free = [True] * num_blocks
        # the step in flight: the copies not yet handed to the scheduler, and what undo_step reverts
        self._stores: list[tuple[int, int]] = []  # (device block id, host block id)
        self._loads: list[tuple[int, int]] = []  # (host block id, device block id)
        self._stored: list[HostEntry] = []  # entries created in the step
        self._loaded: list[KVBlock] = []  # device blocks given an entry's identity in the step
        self._loading_ids: set[int] = set()  # their ids (an eviction of one must not store it)
        self._pinned: list[HostEntry] = []
        self.num_stored_blocks = 0  # device -> host copies of committed steps
        self.num_loaded_blocks = 0  # host -> device copies of committed steps
        self.num_evictions = 0  # entries evicted to make room
        self.num_dropped_stores = 0  # evicted device blocks not stored: every entry pinned

    # --- reads -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def in_step(self) -> bool:
        """Whether a step's copies or pins are outstanding (nothing to commit or undo when False)."""
        return bool(self._pinned or self._stores or self._loads or self._loaded)

    def get(self, block_hash: bytes) -> HostEntry | None:
        return self._entries.get(block_hash)

    def hashes(self) -> list[bytes]:
        """The entries' hashes, LRU first."""
        return list(self._entries)

    # --- the step's changes -----------------------------------------------------------------------
    def store(self, b: KVBlock) -> None:
        """``b``, a published device block being evicted (its identity still set), keeps its KV here."""
        if b.block_id in self._loading_ids:  # its load has not run: there is no KV to keep
            return
        e = self._entries.get(b.block_hash)
        if e is not None:  # already here (inclusive): the same KV, now the most recently used
            self._entries.move_to_end(b.block_hash)
            return
        if not self._free and not self._evict_lru():
            self.num_dropped_stores += 1
            return
        hid = self._free.popleft()
        self._is_free[hid] = False
        e = HostEntry(hid, b)
        self._entries[e.block_hash] = e
        self._stores.append((b.block_id, hid))
        self._stored.append(e)
        self._pinned.append(e)

    def pin(self, e: HostEntry) -> None:
        """Keep ``e`` until the step ends (a hit about to load it)."""
        if not e.pinned:
            e.pinned = True
            self._pinned.append(e)
        self._entries.move_to_end(e.block_hash)

    def load(self, e: HostEntry, b: KVBlock) -> None:
        """Give fresh device block ``b`` the pinned entry ``e``'s identity, and plan the copy of its KV."""
        e.give_identity(b)
        self._loads.append((e.host_block_id, b.block_id))
        self._loaded.append(b)
        self._loading_ids.add(b.block_id)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's ``(device, host)`` stores and ``(host, device)`` loads so far (each handed out once)."""
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        return stores, loads

    def commit_step(self) -> None:
        """The step's copies ran: unpin its entries, count its copies, forget its journal."""
        self.num_stored_blocks += len(self._stored)
        self.num_loaded_blocks += len(self._loaded)
        for e in self._pinned:
            e.pinned = False
        self._pinned.clear()
        self._stored.clear()
        self._loaded.clear()
        self._loading_ids.clear()

    def undo_step(self) -> list[KVBlock]:
        """The step failed (its copies may not have run): drop the entries it stored and return the
        device blocks it loaded (the caller unpublishes them)."""
        for e in self._stored:
            del self._entries[e.block_hash]
            self._release(e.host_block_id)
        for e in self._pinned:
            e.pinned = False
        loaded = list(self._loaded)
        self._stores, self._loads = [], []
        self._pinned.clear()
        self._stored.clear()
        self._loaded.clear()
        self._loading_ids.clear()
        return loaded

    # --- internals ---------------------------------------------------------------------------------
    def _evict_lru(self) -> bool:
        """Evict the least recently used unpinned entry; False when every entry is pinned."""
        for h, e in self._entries.items():
            if not e.pinned:
                del self._entries[h]
                self._release(e.host_block_id)
                self.num_evictions += 1
                return True
        return False

    def _release(self, hid: int) -> None:
        if self._is_free[hid]:
            raise AssertionError(f"host block {hid} released twice")
        self._is_free[hid] = True
        self._free.append(hid)

    def check(self) -> None:
        """Raise AssertionError naming the first broken invariant (module docstring)."""
        held = [e.host_block_id for e in self._entries.values()]
        if len(set(held)) != len(held):
            raise AssertionError(f"host tier invariant broken: a host block held by two entries: {sorted(held)}")
        free = list(self._free)
        if len(set(free)) != len(free) or set(free) & set(held):
            raise AssertionError("host tier invariant broken: a host block free twice, or free and held")
        if len(free) + len(held) != self.num_blocks:
            raise AssertionError(f"host tier invariant broken: {len(free)} free + {len(held)} held != "
                                 f"{self.num_blocks} host blocks")
        if [not f for f in self._is_free] != [i in set(held) for i in range(self.num_blocks)]:
            raise AssertionError("host tier invariant broken: the free flags disagree with the entries")
        for h, e in self._entries.items():
            if e.block_hash != h or prefix_hash.block_hash(e.parent_hash, e.token_ids) != h:
                raise AssertionError(f"host tier invariant broken: entry in host block {e.host_block_id} "
                                     "does not reproduce its hash")
        pinned = {id(e) for e in self._entries.values() if e.pinned}
        if pinned != {id(e) for e in self._pinned}:
            raise AssertionError("host tier invariant broken: pinned entries are not the step's")
