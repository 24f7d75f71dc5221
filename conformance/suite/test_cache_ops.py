"""write_kv and copy_blocks, compared byte-for-byte over the whole cache (a stray write anywhere fails).

The expected cache is computed by plain Python indexing, one token (one block) at a time, from a copy of
the cache taken before the call. Caches start full of random values (with NaN payloads in one block), so
"unchanged" really means unchanged.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import pytest
import torch
from pagedbench.conformance.gate import checks
from pagedbench.conformance.gate.cases import DTYPES


@dataclass(frozen=True, slots=True)
class CacheCase:
    """A cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` and ``num_tokens`` tokens to write."""

    block_size: int = 16
    num_blocks: int = 9
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "fp16"
    index_dtype: str = "int64"  # of slot_mapping / pairs
    num_tokens: int = 20
    num_skipped: int = 3  # tokens with slot -1

    @property
    def id(self) -> str:
        return (f"bs={self.block_size},blocks={self.num_blocks},hkv={self.num_kv_heads},d={self.head_dim},"
                f"{self.dtype},{self.index_dtype},tokens={self.num_tokens},skip={self.num_skipped}")

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())


CONTROL = CacheCase()
WRITE_CASES = [CONTROL, replace(CONTROL, block_size=1, num_blocks=40), replace(CONTROL, block_size=5),
               replace(CONTROL, block_size=32, num_blocks=3), replace(CONTROL, dtype="fp32"),
               replace(CONTROL, dtype="bf16"), replace(CONTROL, index_dtype="int32"),
               replace(CONTROL, head_dim=24, num_kv_heads=1), replace(CONTROL, num_tokens=1, num_skipped=0)]


def random_cache(case: CacheCase, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (case.num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    dt = DTYPES[case.dtype]
    k, v = torch.randn(shape, generator=gen).to(dt), torch.randn(shape, generator=gen).to(dt)
    k[1], v[1] = math.nan, math.nan  # a block of NaNs must survive byte-for-byte too
    return k.to(device), v.to(device)


def slot_mapping(case: CacheCase, gen: torch.Generator) -> torch.Tensor:
    """Distinct random slots for the written tokens, always including slot 0 and the last slot, with
    ``num_skipped`` entries of -1 scattered among them."""
    num_slots = case.num_blocks * case.block_size
    written = case.num_tokens - case.num_skipped
    slots = torch.randperm(num_slots, generator=gen)[:written].tolist()
    for i, must in enumerate((0, num_slots - 1)[:written]):
        if must not in slots:
            slots[i] = must
    for _ in range(case.num_skipped):
        slots.insert(int(torch.randint(len(slots) + 1, (1,), generator=gen)), -1)
    return torch.tensor(slots, dtype=getattr(torch, case.index_dtype))


def expected_write(cache: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = cache.cpu().clone()
    bs = cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s != -1:
            out[s // bs, s % bs] = tokens[t].cpu()
    return out


@pytest.mark.parametrize("case", WRITE_CASES, ids=[f"write_kv/{c.id}" for c in WRITE_CASES])
def test_write_kv_writes_exactly_its_slots(impl, case):
    gen = torch.Generator().manual_seed(case.seed)
    dev = impl.device
    k_cache, v_cache = random_cache(case, gen, dev)
    dt = DTYPES[case.dtype]
    k = torch.randn(case.num_tokens, case.num_kv_heads, case.head_dim, generator=gen).to(dt).to(dev)
    v = torch.randn(case.num_tokens, case.num_kv_heads, case.head_dim, generator=gen).to(dt).to(dev)
    slots = slot_mapping(case, gen)
    want_k, want_v = expected_write(k_cache, k, slots), expected_write(v_cache, v, slots)
    impl.write_kv(k, v, k_cache, v_cache, slots.to(dev))
    checks.assert_bitwise_equal(k_cache, want_k.to(dev), what="k_cache", context=f"write_kv/{case.id}")
    checks.assert_bitwise_equal(v_cache, want_v.to(dev), what="v_cache", context=f"write_kv/{case.id}")


SKIP_CASES = [replace(CONTROL, num_tokens=4, num_skipped=4), replace(CONTROL, num_tokens=1, num_skipped=1,
                                                                      index_dtype="int32")]


@pytest.mark.parametrize("case", SKIP_CASES, ids=[f"write_kv/{c.id}" for c in SKIP_CASES])
def test_write_kv_slot_minus_one_changes_nothing(impl, case):
    """Slot -1 is padding: it must never be used as an index (vLLM #43810 wrote the last slot)."""
    gen = torch.Generator().manual_seed(case.seed)
    dev = impl.device
    k_cache, v_cache = random_cache(case, gen, dev)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    dt = DTYPES[case.dtype]
    k = torch.randn(case.num_tokens, case.num_kv_heads, case.head_dim, generator=gen).to(dt).to(dev)
    slots = torch.full((case.num_tokens,), -1, dtype=getattr(torch, case.index_dtype), device=dev)
    impl.write_kv(k, k.clone(), k_cache, v_cache, slots)
    checks.assert_bitwise_equal(k_cache, before_k, what="k_cache", context=f"write_kv/{case.id}")
    checks.assert_bitwise_equal(v_cache, before_v, what="v_cache", context=f"write_kv/{case.id}")


COPY_CASES = [(CONTROL, 3), (replace(CONTROL, index_dtype="int32"), 4), (replace(CONTROL, block_size=5), 1),
              (replace(CONTROL, dtype="bf16", block_size=1, num_blocks=12), 5), (CONTROL, 0)]


def copy_pairs(num_blocks: int, num_pairs: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """``num_pairs`` (src, dst) rows: distinct destinations, none of them a source; blocks 0 and
    ``num_blocks - 1`` take part whenever there are two pairs or more."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    if num_pairs >= 2:
        order = [0, num_blocks - 1] + [b for b in order if b not in (0, num_blocks - 1)]
    chosen = order[: 2 * num_pairs]
    shuffled = [chosen[i] for i in torch.randperm(len(chosen), generator=gen).tolist()]
    return torch.tensor(shuffled, dtype=dtype).reshape(num_pairs, 2)


@pytest.mark.parametrize("case,num_pairs", COPY_CASES,
                         ids=[f"copy_blocks/{c.id},pairs={n}" for c, n in COPY_CASES])
def test_copy_blocks_copies_exactly_its_pairs(impl, case, num_pairs):
    gen = torch.Generator().manual_seed(case.seed + num_pairs)
    dev = impl.device
    k_cache, v_cache = random_cache(case, gen, dev)
    pairs = copy_pairs(case.num_blocks, num_pairs, gen, getattr(torch, case.index_dtype))
    want_k, want_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    for src, dst in pairs.tolist():
        want_k[dst], want_v[dst] = k_cache[src].cpu(), v_cache[src].cpu()
    impl.copy_blocks(k_cache, v_cache, pairs.to(dev))
    context = f"copy_blocks/{case.id},pairs={pairs.tolist()}"
    checks.assert_bitwise_equal(k_cache, want_k.to(dev), what="k_cache", context=context)
    checks.assert_bitwise_equal(v_cache, want_v.to(dev), what="v_cache", context=context)
