"""The tensor-parallel family's own pieces: its head split is the engine's and never cuts a GQA group,
its shards are what it says (a dense copy, or a view of the shared cache), and its mutant is killed by
this family alone."""

from __future__ import annotations

import pytest
import torch
from pagedbench.conformance.gate import shards
from pagedbench.conformance.tests import test_mutants
from pagedbench.refengine.parallel.linear import ColumnParallelLinear
from torch import nn

SHARDINGS = [shards.Sharding(8, kv, n) for kv in (1, 2, 4, 8) for n in (1, 2, 4) if kv % n == 0]
HEAD_DIM = 3
MUTANT = "mutant-tp-global-kv-head"


def _engine_heads(num_heads: int, rank: int, world_size: int) -> list[int]:
    """The heads the engine's column-parallel projection gives ``rank`` (read from the rows it keeps)."""
    full = nn.Linear(1, num_heads * HEAD_DIM, bias=False)
    with torch.no_grad():
        full.weight.copy_(torch.arange(num_heads * HEAD_DIM, dtype=torch.float32)[:, None])
    rows = ColumnParallelLinear(full, rank, world_size, features_per_unit=HEAD_DIM).weight[:, 0].long()
    return sorted({int(r) // HEAD_DIM for r in rows})


@pytest.mark.parametrize("sharding", SHARDINGS, ids=lambda s: f"hq={s.num_heads},hkv={s.num_kv_heads},{s.id}")
def test_the_split_is_the_engines_and_keeps_every_group_on_one_rank(sharding):
    """Rank r's query and KV heads are the engine's q_proj and k_proj slices, and the query heads of rank r
    read exactly rank r's KV heads: global KV head h // group = the rank's first KV head + h_local // group."""
    kv_start = 0
    for rank in range(sharding.world_size):
        q, kv = sharding.q_heads(rank), sharding.kv_heads(rank)
        assert list(range(q.start, q.stop)) == _engine_heads(sharding.num_heads, rank, sharding.world_size)
        assert list(range(kv.start, kv.stop)) == _engine_heads(sharding.num_kv_heads, rank, sharding.world_size)
        assert kv.start == kv_start
        kv_start = kv.stop
        for local, h in enumerate(range(q.start, q.stop)):
            assert h // sharding.group == kv.start + local // sharding.group < kv.stop
    assert kv_start == sharding.num_kv_heads


def test_a_split_that_would_cut_a_group_or_a_bad_rank_is_refused():
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\) is not divisible by world_size \(4\)"):
        shards.Sharding(8, 2, 4)  # 2 query heads per rank: a group of 4 over two ranks
    with pytest.raises(ValueError, match=r"not a multiple of num_kv_heads"):
        shards.Sharding(6, 4, 2)
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 0"):
        shards.Sharding(8, 2, 0)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        shards.Sharding(8, 2, 2).q_heads(2)
    with pytest.raises(ValueError, match=r"pool must be one of"):
        shards.shard_cache(torch.zeros(2, 4, 2, 8), shards.Sharding(8, 2, 2), 0, "pooled")


def test_an_own_pool_is_a_dense_copy_and_a_shared_cache_a_view_of_the_ranks_heads():
    cache = torch.randn(3, 4, 4, 8)
    sharding = shards.Sharding(8, 4, 2)
    own = shards.shard_cache(cache, sharding, 1, "own-pool")
    shared = shards.shard_cache(cache, sharding, 1, "shared-cache")
    assert own.is_contiguous() and own.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()
    assert shared.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert shared.storage_offset() == 2 * 8 and shared.stride() == cache.stride()  # two heads into each slot
    assert torch.equal(own, cache[:, :, 2:]) and torch.equal(shared, cache[:, :, 2:])


@pytest.mark.mutants
@pytest.mark.parametrize("part", sorted(set(test_mutants.SUITES) - {"block_manager"}))
def test_only_the_tensor_parallel_family_kills_its_mutant(part):
    """The mutant that numbers a shard's KV heads globally passes every other attention family (the block
    manager's, which it does not change, left out) and fails this one."""
    proc = test_mutants.run_suite(MUTANT, part, stop_at_first=True)
    if part == "tensor_parallel":
        assert proc.returncode == 1 and test_mutants.first_failure(proc.stdout), test_mutants._tail(proc)
    else:
        assert proc.returncode == 0, f"the {part} suite kills {MUTANT} too:\n{test_mutants._tail(proc)}"
