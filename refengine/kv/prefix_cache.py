"""The block manager's prefix cache: its lookup of a prompt's cached blocks and the publication of full
blocks, kept apart from the tables and queues (a mixin of
:class:`~pagedbench.refengine.kv.block_manager.BlockManager`, whose state it reads; see that module's
docstring for the rules: chained hashes, verified hits, publication once the KV is written).
"""

from __future__ import annotations

from collections.abc import Hashable

from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.kv import prefix_hash
from pagedbench.refengine.kv.free_block_queue import KVBlock


class PrefixCache:
    """:meth:`publish_blocks` and the lookup and publication it and ``allocate`` share."""

    __slots__ = ()

    def publish_blocks(self, seq_id: Hashable, num_tokens: int) -> None:
        """Mark the first ``num_tokens`` tokens' KV written; cache every full block they cover.

        Call it as chunked prefill writes the prompt (after ``allocate(..., publish=False)``). Blocks
        that later fill through :meth:`append_token` are cached only once every earlier token is written.
        """
        seq = self._get(seq_id)
        n = len(seq.token_ids)
        if type(num_tokens) is not int or not 0 <= num_tokens <= n:
            raise InvalidArgumentError(f"num_tokens must be an int in [0, {n}] for sequence {seq_id!r}, "
                                       f"got {num_tokens!r}")
        if num_tokens > seq.num_computed:
            seq.num_computed = num_tokens
        if self.enable_prefix_caching:
            self._publish(seq, num_tokens // self._block_size)

    # --- internals -------------------------------------------------------------------------------
    def _lookup(self, tokens: list[int], salt: object) -> tuple[list[KVBlock], bytes, object]:
        """The longest verified chain of published blocks for a prompt (never its last token)."""
        bs = self._block_size
        h = prefix_hash.root_hash(salt)
        key: object = ("root", salt)
        hits: list[KVBlock] = []
        cache = self._cache
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            nh = prefix_hash.block_hash(h, chunk)
            b = cache.get(nh)
            if b is None or b.token_ids != chunk or b.parent_key != key:  # miss, or a hash collision
                break
            hits.append(b)
            h, key = nh, b.content_id
        return hits, h, key

    def _publish(self, seq, upto_blocks: int) -> None:
        """Publish ``seq``'s full blocks [num_published, upto_blocks) (an already cached twin is kept)."""
        i = seq.num_published
        if i >= upto_blocks:
            return
        h, key = seq.chain_hash, seq.chain_key
        if key is None:  # the chain met a hash collision: publish nothing more
            seq.num_published = upto_blocks
            return
        bs, cache, tokens = self._block_size, self._cache, seq.token_ids
        while i < upto_blocks:
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            nh = prefix_hash.block_hash(h, chunk)
            existing = cache.get(nh)
            if existing is None:
                b = seq.blocks[i]
                b.block_hash, b.parent_hash, b.token_ids, b.parent_key = nh, h, chunk, key
                adopted = None if self._host is None else self._host_content_id(nh, chunk, key)
                if adopted is None:
                    b.content_id = self._next_content_id
                    self._next_content_id += 1
                else:  # the host tier holds this KV: one content id, so chains across the tiers verify
                    b.content_id = adopted
                cache[nh] = b
                key = b.content_id
            elif existing.token_ids == chunk and existing.parent_key == key:
                b = seq.blocks[i]
                if b.block_hash is None:  # the same KV, computed again in another block: a twin
                    b.block_hash, b.parent_hash, b.token_ids, b.parent_key = nh, h, chunk, key
                    b.content_id = existing.content_id  # children chain off either copy alike
                    self._twins.setdefault(nh, []).append(b)
                key = existing.content_id
            else:  # a collision: never let this chain's children point under another prompt's block
                key = None
                i = upto_blocks
                break
            h = nh
            i += 1
        seq.num_published, seq.chain_hash, seq.chain_key = i, h, key
