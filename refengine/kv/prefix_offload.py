"""The block manager's side of the prefix cache's host tier (:mod:`refengine.kv.host_tier`).

With ``BlockManager(..., num_host_blocks=N)`` (and prefix caching on):

* an evicted cached block whose hash leaves the device (no twin keeps it) is stored in the host tier
  (:meth:`_take_fresh` calls :meth:`HostPrefixTier.store` before forgetting the block's identity);
* a prompt's lookup walks both tiers block by block, the device's first: a block missing on the device
  but present on the host (verified by tokens and parent, as every hit) is a *host hit*; the chain
  goes on after it on either tier;
* ``allocate`` gives each host hit a fresh device block carrying the entry's identity (published at
  once, so another prompt of the same step hits it on the device), pins the entry, and plans the
  ``(host, device)`` load. The returned count includes host hits (their KV is there before the step's
  forward reads it: the executor applies loads first);
* the copies of the step are read once with :meth:`take_offload_copies`; the caller applies them (every
  store, then every load) and calls :meth:`commit_offload_step`; when the step fails instead,
  :meth:`undo_offload_step` drops what it stored and unpublishes what it loaded, and returns the loaded
  device block ids: every table holding one must be freed (its KV was perhaps never copied).

A device block published while its hash is on the host takes the host entry's content id, so chains
that run across both tiers keep verifying.

A mixin of :class:`~pagedbench.refengine.kv.block_manager.BlockManager`.
"""

from __future__ import annotations

from pagedbench.refengine.kv import prefix_hash
from pagedbench.refengine.kv.free_block_queue import KVBlock
from pagedbench.refengine.kv.host_tier import HostEntry, HostPrefixTier


class PrefixOffload:
    """The host tier's lookup, loads, and step protocol of the BlockManager."""

    __slots__ = ()

    @property
    def host_tier(self) -> HostPrefixTier | None:
        """The host tier (None without one)."""
        return self._host

    def take_offload_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies planned since the last call: ``(device, host)`` stores and ``(host, device)`` loads,
        to apply in that order (every store before any load) before anything reads the loaded blocks."""
        if self._host is None:
            return [], []
        return self._host.take_copies()

    def commit_offload_step(self) -> None:
        """The copies handed out have run: the entries they pinned may be evicted again."""
        if self._host is not None and self._host.in_step:
            self._host.commit_step()

    def undo_offload_step(self) -> list[int]:
        """The copies planned since the last commit may not have run: forget the entries stored and
        unpublish the device blocks loaded; returns those blocks' ids (the caller frees every table
        holding one: their KV is not to be trusted)."""
        if self._host is None or not self._host.in_step:
            return []
        loaded = self._host.undo_step()
        for b in loaded:
            if b.block_hash is None:  # (evicted since: it was never stored, see HostPrefixTier.store)
                continue
            self._unmap(b)
            b.clear_cache_entry()
            if b.ref_count == 0:  # freed already: from the cached queue to the uncached one
                self._cached.remove(b)
                self._free.extend([b])
        return [b.block_id for b in loaded]

    # --- internals -------------------------------------------------------------------------------
    def _unmap(self, b: KVBlock) -> bool:
        """Remove published block ``b`` from the cache map (a twin takes its place); True when its hash
        left the device tier."""
        h = b.block_hash
        twins = self._twins.get(h)
        gone = False
        if self._cache[h] is b:
            if twins:
                self._cache[h] = twins.pop()
            else:
                del self._cache[h]
                gone = True
        else:
            twins.remove(b)
        if twins is not None and not twins:
            del self._twins[h]
        return gone

    def _lookup_tiers(self, tokens: list[int], salt: object) -> tuple[list, bytes, object]:
        """:meth:`_lookup` over both tiers: each hit a device block or a HostEntry."""
        bs = self._block_size
        h = prefix_hash.root_hash(salt)
        key: object = ("root", salt)
        hits: list = []
        cache, host = self._cache, self._host
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            nh = prefix_hash.block_hash(h, chunk)
            b = cache.get(nh)
            if b is None or b.token_ids != chunk or b.parent_key != key:
                b = host.get(nh)
                if b is None or b.token_ids != chunk or b.parent_key != key:  # a miss, or a collision
                    break
            hits.append(b)
            h, key = nh, b.content_id
        return hits, h, key

    @staticmethod
    def _tier_needs(hits: list) -> tuple[int, int]:
        """``(host hits, device hits no table holds)``: the first need a fresh block each, the second are
        free blocks the prompt takes back."""
        num_host = num_revived = 0
        for b in hits:
            if type(b) is HostEntry:
                num_host += 1
            elif b.ref_count == 0:
                num_revived += 1
        return num_host, num_revived

    def _take_tier_hits(self, hits: list, num_fresh: int) -> tuple[list[KVBlock], int, int]:
        """allocate's taking of its hits and fresh blocks with a host tier (the fit already checked):
        the table, the hits whose tokens become live again, and the host hits."""
        host = self._host
        entries = []
        revived = 0
        for b in hits:  # device hits and pins first: the fresh blocks' evictions must not take them
            if type(b) is HostEntry:
                host.pin(b)
                entries.append(b)
            else:
                if b.ref_count == 0:
                    self._cached.remove(b)
                    revived += 1
                b.ref_count += 1
        fresh = self._take_fresh_many(num_fresh)
        loaded = iter(fresh[:len(entries)])
        table = []
        for b in hits:
            if type(b) is HostEntry:
                d = next(loaded)
                host.load(b, d)
                self._map_loaded(d)
                table.append(d)
            else:
                table.append(b)
        return table + fresh[len(entries):], revived + len(entries), len(entries)

    def _map_loaded(self, d: KVBlock) -> None:
        h = d.block_hash
        if h in self._cache:  # (only a hash repeated within one prompt's chain could do this)
            self._twins.setdefault(h, []).append(d)
        else:
            self._cache[h] = d

    def _host_content_id(self, nh: bytes, chunk: tuple, key: object) -> int | None:
        """The content id of the host entry holding exactly this block (hash, tokens, parent), if any."""
        e = self._host.get(nh)
        if e is not None and e.token_ids == chunk and e.parent_key == key:
            return e.content_id
        return None
