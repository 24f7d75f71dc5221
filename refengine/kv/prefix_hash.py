"""Chained prefix-cache hashes of full KV blocks (SHA-256 from ``hashlib``).

A chain starts at a root that depends only on the request's ``cache_salt``, and every full block's
hash covers its parent's hash and its own token ids::

    root    = SHA-256(b"pagedbench/kv-root/1" | tag(salt) | salt bytes)
    hash[0] = SHA-256(root      | token ids of block 0 as little-endian uint64)
    hash[i] = SHA-256(hash[i-1] | token ids of block i as little-endian uint64)

So two prompts share block ``i`` only if they agree on every token up to the end of block ``i`` *and*
on the salt: different salts never share any block (tenant isolation, vLLM #44701). A predictable
hash once let an attacker forge collisions in vLLM (GHSA-rm76-4mrf-v9r8); SHA-256 is the choice here,
and the block manager still verifies the cached block's tokens and parent on every hit, so even a
collision can never serve another prompt's KV.

The block manager calls these through the module (``prefix_hash.block_hash``), so a test may
monkeypatch them to force collisions.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

#: token ids must lie in [0, MAX_TOKEN_ID) to be encoded as uint64
MAX_TOKEN_ID = 2**63

_ROOT_DOMAIN = b"pagedbench/kv-root/1"
_BIG_ENDIAN = sys.byteorder == "big"


def salt_bytes(cache_salt: str | bytes | None) -> bytes:
    """The salt's unambiguous encoding: None, a str and bytes never encode alike."""
    if cache_salt is None:
        return b"\x00"
    if isinstance(cache_salt, str):
        return b"\x01" + cache_salt.encode("utf-8")
    if isinstance(cache_salt, bytes):
        return b"\x02" + cache_salt
    raise TypeError(f"cache_salt must be str, bytes or None, got {type(cache_salt).__name__}")


def root_hash(cache_salt: str | bytes | None) -> bytes:
    """The parent hash of a chain's first block for requests with this salt (32 bytes)."""
    return hashlib.sha256(_ROOT_DOMAIN + salt_bytes(cache_salt)).digest()


def block_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block given its parent's hash (32 bytes). Tokens must be in [0, 2**63)."""
    words = array("Q", token_ids)
    if _BIG_ENDIAN:  # the same hash on every machine
        words.byteswap()
    return hashlib.sha256(parent_hash + words.tobytes()).digest()
