"""Tensor-parallel shards of one attention call: which heads each rank holds, and its tensors.

Megatron's column-parallel QKV projection (our engine's ``LLM(tensor_parallel_size=N)``) gives rank ``r``
the query heads ``[r*H/N, (r+1)*H/N)`` and the KV heads ``[r*Hkv/N, (r+1)*Hkv/N)``. The slices are
contiguous, so a GQA group never straddles two ranks (``H/N = (Hkv/N) * group``): local query head ``h``
of rank ``r`` reads local KV head ``h // group``, which is global KV head ``r*Hkv/N + h // group``. Every
rank's pool has the same blocks, so the block tables, lengths and slot mappings are the same on every rank.

A rank's KV cache comes in one of two pools::

    own-pool      a copy of the rank's heads: a dense [num_blocks, block_size, Hkv/N, D] tensor per rank,
                  as each rank's block pool is in the engine
    shared-cache  a view of the rank's heads in one cache holding every head, as one process serving
                  every rank from one allocation has: each slot of rank r's view starts r*Hkv/N heads in

                  one slot, Hkv = 4, N = 2:   | h0 h1 | h2 h3 |
                                                rank 0  rank 1
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from pagedbench.conformance.gate.builders import PagedInputs

__all__ = ["POOLS", "Sharding", "shard_cache", "shard_inputs"]

POOLS = ("own-pool", "shared-cache")


@dataclass(frozen=True, slots=True)
class Sharding:
    """``num_heads`` query heads and ``num_kv_heads`` KV heads split over ``world_size`` ranks."""

    num_heads: int
    num_kv_heads: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Sharding.{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_kv_heads % self.world_size:
            # fewer KV heads than ranks would need replicas of a KV head and a group cut in two; the
            # engine refuses it too
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) is not divisible by world_size "
                             f"({self.world_size})")

    @property
    def id(self) -> str:
        return f"tp={self.world_size}"

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return self.num_kv_heads // self.world_size

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")

    def q_heads(self, rank: int) -> slice:
        """The global query heads rank ``rank`` holds."""
        self._check_rank(rank)
        return slice(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank)

    def kv_heads(self, rank: int) -> slice:
        """The global KV heads rank ``rank`` holds."""
        self._check_rank(rank)
        return slice(rank * self.kv_heads_per_rank, (rank + 1) * self.kv_heads_per_rank)


def shard_cache(cache: torch.Tensor, sharding: Sharding, rank: int, pool: str) -> torch.Tensor:
    """Rank ``rank``'s heads of ``cache`` ``[num_blocks, block_size, Hkv, D]``: a dense copy (``own-pool``)
    or a view into ``cache`` (``shared-cache``)."""
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    if cache.shape[2] != sharding.num_kv_heads:
        raise ValueError(f"cache has {cache.shape[2]} KV heads, the sharding {sharding.num_kv_heads}")
    view = cache[:, :, sharding.kv_heads(rank)]
    return view.contiguous() if pool == "own-pool" else view


def shard_inputs(x: PagedInputs, sharding: Sharding, rank: int, pool: str) -> PagedInputs:
    """Rank ``rank``'s call: its query heads (dense, as its own projection makes them), its KV heads of
    the caches in ``pool``, the same block tables, lengths and query offsets."""
    if x.q.shape[1] != sharding.num_heads:
        raise ValueError(f"q has {x.q.shape[1]} heads, the sharding {sharding.num_heads}")
    return replace(x, q=x.q[:, sharding.q_heads(rank)].contiguous(),
                   k_cache=shard_cache(x.k_cache, sharding, rank, pool),
                   v_cache=shard_cache(x.v_cache, sharding, rank, pool))
