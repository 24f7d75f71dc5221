"""The block manager's metrics snapshot and its invariant check (kept apart from the hot path).

Invariants :func:`check_invariants` verifies, each named in the AssertionError it raises:

* ``free queues``: each queue's links, length and membership are consistent (FreeBlockQueue.check);
* ``ref counts``: every block's ref count equals the number of block tables holding it;
* ``free list``: a block is in a free queue iff its ref count is 0; the cached queue holds exactly the
  free published blocks, the uncached queue the free unpublished ones;
* ``accounting``: free + cached + used == num_blocks (no block lost or counted twice);
* ``tables``: every sequence has >= 1 token, ceil(tokens / block_size) blocks, no block twice, and
  publishes no block before its tokens are computed;
* ``cache map``: every entry maps its hash to a block carrying that hash, the hash is reproduced by the
  block's parent hash and tokens, every published block is in the map, content ids are unique;
* ``cached tokens``: a published block held by a table carries exactly that table's tokens there;
* ``host tier`` (with one): its own accounting and hashes (HostPrefixTier.check); a hash on both tiers
  with the same tokens and parent has one content id; a block loaded in the step in flight is published.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedbench.refengine.kv import prefix_hash

if TYPE_CHECKING:
    from pagedbench.refengine.kv.block_manager import BlockManager


@dataclass(frozen=True, slots=True)
class BlockManagerMetrics:
    """A snapshot of the block manager's state and counters (``dataclasses.asdict`` gives a dict)."""

    num_blocks: int  # blocks in the pool
    block_size: int  # token slots per block
    num_sequences: int  # sequences holding a block table
    used_blocks: int  # blocks held by at least one table
    free_blocks: int  # free blocks holding no cached KV
    cached_blocks: int  # free blocks holding published KV (evictable; used + free + cached = num_blocks)
    published_blocks: int  # blocks in the prefix-cache map (in use or cached)
    live_tokens: int  # token states held (a token in a shared block counts once)
    allocated_slots: int  # used_blocks * block_size
    internal_fragmentation_slots: int  # allocated_slots - live_tokens
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache (successful allocations)
    prefix_hit_tokens: int  # of those, tokens served from the cache
    evictions: int  # cached blocks evicted to make room
    copy_on_write_copies: int  # (src, dst) copies reported by append_token
    forks: int  # successful fork() calls
    failed_allocations: int  # allocate() calls rejected with OutOfBlocksError
    # the prefix cache's host tier (0 without one); hits there are never counted in prefix_hit_tokens
    prefix_host_hit_tokens: int = 0  # of prefix_query_tokens, tokens loaded from the host tier
    host_blocks: int = 0  # blocks of the host tier
    host_cached_blocks: int = 0  # host blocks holding an evicted block's KV
    host_stored_blocks: int = 0  # device -> host copies (evicted blocks kept), committed steps
    host_loaded_blocks: int = 0  # host -> device copies (host hits), committed steps
    host_evictions: int = 0  # host entries evicted (LRU) to make room
    host_dropped_stores: int = 0  # evicted device blocks the host tier could not take (all pinned)

    @property
    def prefix_computed_tokens(self) -> int:
        """Prompt tokens looked up and served by neither tier: computed."""
        return self.prefix_query_tokens - self.prefix_hit_tokens - self.prefix_host_hit_tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def compute_metrics(bm: BlockManager) -> BlockManagerMetrics:
    """O(blocks held) snapshot of ``bm``."""
    bs = bm.block_size
    filled: dict[int, int] = {}  # block id -> slots holding a token (max over the tables sharing it)
    for seq in bm._seqs.values():
        n = seq.num_tokens
        for i, b in enumerate(seq.blocks):
            k = min(bs, n - i * bs)
            if k > filled.get(b.block_id, 0):
                filled[b.block_id] = k
    used = bm.num_used_blocks
    live = sum(filled.values())
    return BlockManagerMetrics(
        num_blocks=bm.num_blocks, block_size=bs, num_sequences=len(bm._seqs), used_blocks=used,
        free_blocks=len(bm._free), cached_blocks=len(bm._cached),
        published_blocks=len(bm._cache) + sum(len(t) for t in bm._twins.values()),
        live_tokens=live, allocated_slots=used * bs, internal_fragmentation_slots=used * bs - live,
        prefix_query_tokens=bm._prefix_query_tokens, prefix_hit_tokens=bm._prefix_hit_tokens,
        evictions=bm._evictions, copy_on_write_copies=bm._copy_on_write_copies, forks=bm._forks,
        failed_allocations=bm._failed_allocations, **_host_metrics(bm),
    )


def _host_metrics(bm: BlockManager) -> dict[str, int]:
    host = bm._host
    if host is None:
        return {}
    return dict(prefix_host_hit_tokens=bm._host_hit_tokens, host_blocks=host.num_blocks,
                host_cached_blocks=len(host), host_stored_blocks=host.num_stored_blocks,
                host_loaded_blocks=host.num_loaded_blocks, host_evictions=host.num_evictions,
                host_dropped_stores=host.num_dropped_stores)


def _fail(invariant: str, detail: str) -> None:
    raise AssertionError(f"block manager invariant {invariant!r} broken: {detail}")


def check_invariants(bm: BlockManager) -> None:
    """Raise AssertionError naming the first broken invariant (module docstring)."""
    bm._free.check("free queues (uncached)")
    bm._cached.check("free queues (cached)")
    _check_tables(bm)
    _check_blocks(bm)
    _check_cache_map(bm)
    if bm._host is not None:
        _check_host_tier(bm)
    live = compute_metrics(bm).live_tokens
    if bm.num_live_tokens != live:
        _fail("live tokens", f"the running count says {bm.num_live_tokens}, the tables hold {live}")
    entries = sum(len(seq.blocks) for seq in bm._seqs.values())
    if bm.num_table_blocks != entries:
        _fail("table blocks", f"the running count says {bm.num_table_blocks}, the tables have {entries}")


def _check_tables(bm: BlockManager) -> None:
    bs = bm.block_size
    for seq_id, seq in bm._seqs.items():
        n = seq.num_tokens
        if n < 1:
            _fail("tables", f"sequence {seq_id!r} holds no token")
        if len(seq.blocks) != -(-n // bs):
            _fail("tables", f"sequence {seq_id!r} has {n} tokens in {len(seq.blocks)} blocks of {bs}, "
                            f"expected {-(-n // bs)}")
        ids = [b.block_id for b in seq.blocks]
        if len(set(ids)) != len(ids):
            _fail("tables", f"sequence {seq_id!r} holds a block twice: {ids}")
        if not 0 <= seq.num_computed <= n:
            _fail("tables", f"sequence {seq_id!r} has {seq.num_computed} computed of {n} tokens")
        if bm.enable_prefix_caching and not 0 <= seq.num_published <= seq.num_computed // bs:
            _fail("tables", f"sequence {seq_id!r} has {seq.num_published} blocks published but only "
                            f"{seq.num_computed} tokens computed")
        for i, b in enumerate(seq.blocks):  # (a cached block's tokens are written: none told late)
            if b.token_ids is not None and b.token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                _fail("cached tokens", f"block {b.block_id} of sequence {seq_id!r} caches other tokens")


def _check_blocks(bm: BlockManager) -> None:
    held = Counter(b.block_id for seq in bm._seqs.values() for b in seq.blocks)
    free_ids = set(bm._free.block_ids())
    cached_ids = set(bm._cached.block_ids())
    for b in bm._blocks:
        if b.ref_count != held.get(b.block_id, 0):
            _fail("ref counts", f"block {b.block_id} has ref count {b.ref_count} but "
                                f"{held.get(b.block_id, 0)} tables hold it")
        in_free, in_cached = b.block_id in free_ids, b.block_id in cached_ids
        if (b.ref_count == 0) != (in_free or in_cached) or (in_free and in_cached):
            _fail("free list", f"block {b.block_id} with ref count {b.ref_count}: in uncached queue "
                               f"{in_free}, in cached queue {in_cached}")
        if in_free and b.block_hash is not None:
            _fail("free list", f"published block {b.block_id} is in the uncached free queue")
        if in_cached and b.block_hash is None:
            _fail("free list", f"unpublished block {b.block_id} is in the cached free queue")
    used = sum(1 for b in bm._blocks if b.ref_count > 0)
    if used + len(bm._free) + len(bm._cached) != bm.num_blocks:
        _fail("accounting", f"used {used} + free {len(bm._free)} + cached {len(bm._cached)} "
                            f"!= {bm.num_blocks} blocks")


def _check_cache_map(bm: BlockManager) -> None:
    bs = bm.block_size
    for h, b in bm._cache.items():
        if b.block_hash != h:
            _fail("cache map", f"hash {h.hex()[:12]} maps to block {b.block_id} carrying another hash")
        if b.token_ids is None or len(b.token_ids) != bs or b.parent_hash is None:
            _fail("cache map", f"published block {b.block_id} lacks its tokens or parent hash")
        if prefix_hash.block_hash(b.parent_hash, b.token_ids) != h:
            _fail("cache map", f"block {b.block_id}'s tokens do not reproduce its hash")
    for h, twins in bm._twins.items():
        first = bm._cache.get(h)
        for b in twins:
            if first is None or b is first or b.block_hash != h or b.token_ids != first.token_ids \
                    or b.content_id != first.content_id or b.parent_key != first.parent_key:
                _fail("cache map", f"twin block {b.block_id} does not hold the same KV as the block its hash maps to")
    published = [b for b in bm._blocks if b.block_hash is not None]
    num_twins = sum(len(t) for t in bm._twins.values())
    if len(published) != len(bm._cache) + num_twins:
        _fail("cache map", f"{len(published)} blocks carry a hash but the map has {len(bm._cache)} "
                           f"and {num_twins} twins")
    if len({b.content_id for b in published}) != len(bm._cache):
        _fail("cache map", "two published blocks with different KV share a content id")


def _check_host_tier(bm: BlockManager) -> None:
    host = bm._host
    try:
        host.check()
    except AssertionError as e:
        _fail("host tier", str(e))
    for h in host.hashes():
        e, b = host.get(h), bm._cache.get(h)
        if b is not None and b.token_ids == e.token_ids and b.parent_key == e.parent_key \
                and b.content_id != e.content_id:
            _fail("host tier", f"hash {h.hex()[:12]} has content id {b.content_id} on the device and "
                               f"{e.content_id} on the host")
    for b in host._loaded:
        if b.block_hash is not None and b is not bm._cache.get(b.block_hash) \
                and b not in bm._twins.get(b.block_hash, ()):
            _fail("host tier", f"block {b.block_id}, loaded in the step in flight, is not in the cache map")
