"""The batched block copy between a device KV pool and a host pool (swap preemption, the prefix cache's
host tier): ``impl.copy_blocks_between(src_k, src_v, dst_k, dst_v, pairs)`` copies block ``s`` of the
source caches into block ``d`` of the destination caches for each ``(s, d)``.

Every check is byte-for-byte over whole caches: after a device -> host -> device round trip through
shuffled block ids (into blocks poisoned with NaN), every slot of every copied block equals the original
and no other block changed. Through the implementation's block manager (when it swaps tables), a block two
sequences share is copied once and shared again after the round trip.
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
class HostCopyCase:
    block_size: int = 16
    num_blocks: int = 9  # device blocks
    num_host_blocks: int = 7
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "fp16"
    num_pairs: int = 4

    @property
    def id(self) -> str:
        return (f"host_copy/bs={self.block_size},blocks={self.num_blocks},host={self.num_host_blocks},"
                f"hkv={self.num_kv_heads},d={self.head_dim},{self.dtype},pairs={self.num_pairs}")

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())


CONTROL = HostCopyCase()
CASES = [CONTROL, replace(CONTROL, dtype="fp32"), replace(CONTROL, dtype="bf16"),
         replace(CONTROL, block_size=1, num_blocks=13, num_pairs=7), replace(CONTROL, num_pairs=1),
         replace(CONTROL, num_pairs=7)]  # every host block


def caches(n: int, case: HostCopyCase, gen: torch.Generator, device, *, fill: float | None = None):
    shape = (n, case.block_size, case.num_kv_heads, case.head_dim)
    if fill is not None:
        return (torch.full(shape, fill, dtype=DTYPES[case.dtype], device=device),
                torch.full(shape, fill, dtype=DTYPES[case.dtype], device=device))
    return (torch.randn(shape, generator=gen).to(DTYPES[case.dtype]).to(device),
            torch.randn(shape, generator=gen).to(DTYPES[case.dtype]).to(device))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_round_trip_through_the_host_keeps_every_slot(impl, case):
    gen = torch.Generator().manual_seed(case.seed)
    dev = impl.device
    k, v = caches(case.num_blocks, case, gen, dev)
    k[0, 0], v[0, 0] = math.nan, math.nan  # a NaN payload must survive too
    original = (k.clone(), v.clone())
    host_k, host_v = caches(case.num_host_blocks, case, gen, "cpu", fill=math.nan)
    src = torch.randperm(case.num_blocks, generator=gen)[:case.num_pairs].tolist()
    if 0 not in src:
        src[0] = 0
    dst = torch.randperm(case.num_host_blocks, generator=gen)[:case.num_pairs].tolist()
    host_before = (host_k.clone(), host_v.clone())
    impl.copy_blocks_between(k, v, host_k, host_v, list(zip(src, dst)))
    for got, before, dev_cache, what in ((host_k, host_before[0], k, "host k"), (host_v, host_before[1], v, "host v")):
        want = before.clone()
        want[dst] = dev_cache.cpu()[src]
        checks.assert_bitwise_equal(got, want, what=what, context=f"{case.id}, device -> host")
    fresh = torch.randperm(case.num_blocks, generator=gen)[:case.num_pairs].tolist()  # another place
    k[fresh], v[fresh] = math.nan, math.nan
    poisoned = (k.clone(), v.clone())
    impl.copy_blocks_between(host_k, host_v, k, v, list(zip(dst, fresh)))
    for got, before, orig, what in ((k, poisoned[0], original[0], "k"), (v, poisoned[1], original[1], "v")):
        want = before.clone()
        want[fresh] = orig[src]
        checks.assert_bitwise_equal(got, want, what=f"{what}_cache", context=f"{case.id}, host -> device")


def test_a_shared_block_is_copied_once_and_shared_again(impl):
    bm = impl.block_manager(12, 4)
    if not all(hasattr(bm, m) for m in ("swap_out", "swap_in")):
        pytest.skip(f"not supported: {impl.name}'s block manager does not swap tables")
    case = replace(CONTROL, block_size=4, num_blocks=12, num_host_blocks=8)
    gen = torch.Generator().manual_seed(case.seed)
    k, v = caches(12, case, gen, impl.device)
    bm.allocate("a", list(range(10)))  # three blocks, the last partial
    bm.fork("a", "b")
    tables = {s: bm.block_table(s) for s in ("a", "b")}
    want = {s: (k[t].clone(), v[t].clone()) for s, t in tables.items()}
    swapped = bm.swap_out(["a", "b"])
    ids = list(swapped.block_ids)
    assert sorted(ids) == sorted(set(tables["a"])), f"the shared blocks listed {ids}, not once each"
    host_k, host_v = caches(8, case, gen, "cpu", fill=math.nan)
    impl.copy_blocks_between(k, v, host_k, host_v, [(b, i) for i, b in enumerate(ids)])
    k.fill_(math.nan)
    v.fill_(math.nan)
    bm.allocate("c", list(range(20, 25)))  # the swap-in lands on other blocks
    placed = bm.swap_in(swapped)
    impl.copy_blocks_between(host_k, host_v, k, v, [(i, d) for i, d in placed])
    assert bm.block_table("a") == bm.block_table("b"), "the round trip split a shared table"
    assert [bm.ref_count(b) for b in bm.block_table("a")] == [2, 2, 2]
    for s in ("a", "b"):
        t = bm.block_table(s)
        checks.assert_bitwise_equal(k[t], want[s][0], what="k_cache", context=f"host_copy/shared, sequence {s}")
        checks.assert_bitwise_equal(v[t], want[s][1], what="v_cache", context=f"host_copy/shared, sequence {s}")
