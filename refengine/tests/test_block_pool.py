"""BlockPool: layout, zero-copy sharing with torch, sizing, poison, slot writes, block copies, reads."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from pagedbench.refengine import BlockPool
from pagedbench.refengine.errors import InsufficientMemoryError, InvalidArgumentError
from pagedbench.refengine.kv import block_pool as block_pool_module

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
L, HKV, D, BS = 2, 2, 4, 4  # tiny shapes: 2 layers, 2 KV heads, head_dim 4, block_size 4


def make(dtype=torch.float32, num_blocks=5, **kw) -> BlockPool:
    return BlockPool(L, HKV, D, BS, dtype, num_blocks=num_blocks, **kw)


def snapshot(pool: BlockPool) -> list[np.ndarray]:
    """Every slab's raw bits (NaN-safe to compare)."""
    return [a.copy() for layer in range(pool.num_layers) for a in pool.arrays(layer)]


def assert_unchanged(pool: BlockPool, before: list[np.ndarray]) -> None:
    for a, b in zip(snapshot(pool), before):
        np.testing.assert_array_equal(a, b)


def as_bytes(x: float, dtype: torch.dtype) -> bytes:
    return torch.tensor([x], dtype=dtype).view(torch.uint8).numpy().tobytes()


def randn(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HKV, D, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layout_dtype_and_poison(dtype):
    pool = make(dtype)
    dims = (pool.num_layers, pool.num_blocks, pool.block_size, pool.num_kv_heads, pool.head_dim)
    assert dims == (L, 5, BS, HKV, D)
    assert pool.device == torch.device("cpu")
    for layer in range(L):
        for t in (pool.k(layer), pool.v(layer)):
            assert t.shape == (5, BS, HKV, D) and t.dtype == dtype and t.is_contiguous()
            assert torch.isnan(t).all(), "fresh memory must be poisoned with NaN"
    zeroed = make(dtype, poison=False)
    assert all((t == 0).all() for kv in zeroed.kv_caches() for t in kv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_copy_both_ways(dtype):
    pool = make(dtype)
    k_arr, v_arr = pool.arrays(1)
    k = pool.k(1)
    assert k.data_ptr() == k_arr.ctypes.data and pool.v(1).data_ptr() == v_arr.ctypes.data
    assert k_arr.itemsize == k.element_size()
    k[2, 3, 1, 0] = 1.5  # torch -> array
    assert k_arr[2, 3, 1, 0].tobytes() == as_bytes(1.5, dtype)
    k_arr[0, 0, 0, 0] = np.frombuffer(as_bytes(-2.0, dtype), dtype=k_arr.dtype)[0]
    assert k[0, 0, 0, 0].item() == -2.0  # array -> torch


def test_views_are_made_once():
    pool = make()
    assert pool.k(0) is pool.k(0) and pool.v(1) is pool.v(1)
    same = [(k is pool.k(i), v is pool.v(i)) for i, (k, v) in enumerate(pool.kv_caches())]
    assert same == [(True, True)] * L
    ptrs = [t.data_ptr() for kv in pool.kv_caches() for t in kv]
    pool.write_slots(0, [1], randn(1, pool.dtype, 0), randn(1, pool.dtype, 1))
    pool.copy_blocks([(0, 1)])
    assert [t.data_ptr() for kv in pool.kv_caches() for t in kv] == ptrs


def test_dlpack_path_is_zero_copy(monkeypatch):
    """The GPU path exports with DLPack; NumPy stands in for CuPy to prove the view shares memory."""
    monkeypatch.setattr(block_pool_module, "_array_module", lambda: (np, torch.from_dlpack))
    pool = make(torch.bfloat16)
    k_arr, _ = pool.arrays(0)
    assert pool.k(0).data_ptr() == k_arr.ctypes.data and torch.isnan(pool.k(0)).all()
    pool.k(0).zero_()
    assert not k_arr.any()


@pytest.mark.parametrize("dtype,per_elem", [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)],
                         ids=str)
def test_sizing_from_memory_budget(dtype, per_elem):
    per_block = 2 * L * BS * HKV * D * per_elem  # every layer, K and V
    pool = BlockPool(L, HKV, D, BS, dtype, memory_bytes=3 * per_block + per_block - 1)
    assert pool.bytes_per_block == per_block
    assert pool.num_blocks == 3 and pool.total_bytes == 3 * per_block
    assert BlockPool(L, HKV, D, BS, dtype, memory_bytes=per_block).num_blocks == 1
    with pytest.raises(InvalidArgumentError, match=rf"memory_bytes={per_block - 1} is smaller than one block "
                                                   rf"\({per_block} bytes"):
        BlockPool(L, HKV, D, BS, dtype, memory_bytes=per_block - 1)


@pytest.mark.parametrize("kw,match", [
    ({}, "exactly one of num_blocks or memory_bytes"),
    ({"num_blocks": 2, "memory_bytes": 4096}, "exactly one of num_blocks or memory_bytes"),
    ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
    ({"num_blocks": 2.0}, "num_blocks must be an int, got float"),
    ({"memory_bytes": 0}, "memory_bytes must be >= 1, got 0"),
])
def test_bad_sizes(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        BlockPool(L, HKV, D, BS, **kw)


def test_bad_shape_dtype_device():
    with pytest.raises(InvalidArgumentError, match="block_size must be >= 1, got 0"):
        BlockPool(L, HKV, D, 0, num_blocks=1)
    with pytest.raises(InvalidArgumentError, match=r"dtype must be one of .*got torch.int8"):
        BlockPool(L, HKV, D, BS, torch.int8, num_blocks=1)
    with pytest.raises(InvalidArgumentError, match="device must be the backend's cpu, got meta"):
        BlockPool(L, HKV, D, BS, num_blocks=1, device="meta")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_slots_then_read_sequence_shuffled_table(dtype):
    pool = make(dtype, num_blocks=6)
    table = [4, 0, 5]  # shuffled, includes block 0 and the last block
    n = 10  # partial last block: 2 of 4 slots
    slots = [table[p // BS] * BS + p % BS for p in range(n)]
    k, v = randn(n, dtype, 1), randn(n, dtype, 2)
    pool.write_slots(1, torch.tensor(slots), k, v)
    got_k, got_v = pool.read_sequence(1, table, n)
    assert got_k.shape == (n, HKV, D) and got_k.dtype == dtype
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert torch.isnan(pool.k(1)[5, 2:]).all(), "slots past the sequence stay poisoned"
    assert torch.isnan(pool.k(0)).all(), "another layer is untouched"
    assert torch.isnan(pool.k(1)[[1, 2, 3]]).all(), "blocks outside the table are untouched"
    got_k.zero_()  # a copy: the pool is unaffected
    assert torch.equal(pool.read_sequence(1, table, n)[0], k)


def test_padding_slot_is_never_written():
    """Slot -1 is padding: it must not wrap around to the last slot (vLLM #43810)."""
    pool = make()
    k, v = randn(3, pool.dtype, 3), randn(3, pool.dtype, 4)
    pool.write_slots(0, [2, -1, 7], k, v)
    flat_k = pool.k(0).reshape(-1, HKV, D)
    assert torch.isnan(flat_k[-1]).all() and torch.isnan(pool.v(0).reshape(-1, HKV, D)[-1]).all()
    assert torch.equal(flat_k[2], k[0]) and torch.equal(flat_k[7], k[2])


@pytest.mark.parametrize("slots,match", [
    ([0, 20], r"slot must be in \[0, 20\) or the padding slot -1, got 20"),
    ([-2, 1], r"slot must be in \[0, 20\) or the padding slot -1, got -2"),
    ([3, 3], "slots must be distinct"),
    ([[0, 1]], "slots must be a 1-D int tensor"),
    ([0.0, 1.0], "slots must be a 1-D int tensor"),
])
def test_write_slots_rejects_bad_slots_and_writes_nothing(slots, match):
    pool = make(num_blocks=5)  # 20 slots
    before = snapshot(pool)
    n = len(slots) if isinstance(slots[0], (int, float)) else 2
    with pytest.raises(InvalidArgumentError, match=match):
        pool.write_slots(0, slots, randn(n, pool.dtype, 5), randn(n, pool.dtype, 6))
    assert_unchanged(pool, before)


def test_write_slots_rejects_bad_tensors():
    pool = make()
    before = snapshot(pool)
    with pytest.raises(InvalidArgumentError,
                       match=r"k must be \[2, 2, 4\] torch.float32 on cpu; got \[2, 2, 3\]"):
        pool.write_slots(0, [0, 1], torch.zeros(2, HKV, 3), torch.zeros(2, HKV, D))
    with pytest.raises(InvalidArgumentError, match=r"v must be .* got .*torch.float16"):
        pool.write_slots(0, [0, 1], torch.zeros(2, HKV, D), torch.zeros(2, HKV, D, dtype=torch.float16))
    with pytest.raises(InvalidArgumentError, match=r"layer must be in \[0, 2\), got 2"):
        pool.write_slots(2, [0], torch.zeros(1, HKV, D), torch.zeros(1, HKV, D))
    assert_unchanged(pool, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_every_layer_k_and_v(dtype):
    pool = make(dtype, num_blocks=6)
    for layer in range(L):
        pool.write_slots(layer, torch.arange(24), randn(24, dtype, 10 + layer), randn(24, dtype, 20 + layer))
    before = [(k.clone(), v.clone()) for k, v in pool.kv_caches()]
    pool.copy_blocks([(1, 4), (0, 5)])
    for (k, v), (k0, v0) in zip(pool.kv_caches(), before):
        for cache, old in ((k, k0), (v, v0)):
            assert torch.equal(cache[4], old[1]) and torch.equal(cache[5], old[0])
            assert torch.equal(cache[:4], old[:4]), "sources and other blocks unchanged"


def test_copy_blocks_reads_all_sources_before_writing():
    pool = make(num_blocks=4)
    pool.write_slots(0, torch.arange(16), randn(16, pool.dtype, 7), randn(16, pool.dtype, 8))
    old = pool.k(0).clone()
    pool.copy_blocks([(0, 1), (1, 2)])  # block 2 gets block 1's OLD content
    assert torch.equal(pool.k(0)[1], old[0]) and torch.equal(pool.k(0)[2], old[1])


@pytest.mark.parametrize("pairs,match", [
    ([(0, 5)], r"dst block id must be in \[0, 5\), got 5"),
    ([(1, 2), (-1, 3)], r"src block id must be in \[0, 5\), got -1"),
    ([(0, 2), (1, 2)], r"destination blocks must be distinct, repeated: \[2\]"),
    ([(0, 1, 2)], r"takes \(src, dst\) pairs"),
])
def test_copy_blocks_rejects_bad_ids_and_writes_nothing(pairs, match):
    pool = make(num_blocks=5)
    pool.write_slots(0, torch.arange(20), randn(20, pool.dtype, 9), randn(20, pool.dtype, 10))
    before = snapshot(pool)
    with pytest.raises(InvalidArgumentError, match=match):
        pool.copy_blocks(pairs)
    assert_unchanged(pool, before)
    pool.copy_blocks([])  # empty: a no-op
    assert_unchanged(pool, before)


def test_read_sequence_errors():
    pool = make()
    with pytest.raises(InvalidArgumentError,
                       match=r"block_table has 1 blocks; 5 tokens need 2 \(block_size 4\)"):
        pool.read_sequence(0, [0], 5)
    with pytest.raises(InvalidArgumentError, match=r"block_table block id must be in \[0, 5\), got 9"):
        pool.read_sequence(0, [0, 9], 5)
    with pytest.raises(InvalidArgumentError, match="num_tokens must be an int >= 0"):
        pool.read_sequence(0, [0], -1)
    k, v = pool.read_sequence(0, [], 0)
    assert k.shape == (0, HKV, D) and v.shape == (0, HKV, D)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_write_slots_accepts_int32_and_int64_slot_tensors(index_dtype):
    pool = make(num_blocks=5)
    k, v = randn(2, pool.dtype, 11), randn(2, pool.dtype, 12)
    pool.write_slots(1, torch.tensor([19, 0], dtype=index_dtype), k, v)  # the last slot and the first
    flat = pool.k(1).reshape(-1, HKV, D)
    assert torch.equal(flat[19], k[0]) and torch.equal(flat[0], k[1])


def test_a_pool_larger_than_available_memory_is_refused_before_allocating():
    calls = []

    def probe(is_gpu):
        calls.append(is_gpu)
        return 1000

    with pytest.raises(InsufficientMemoryError, match=r"needs 1,024 bytes .* host has 1,000 bytes available"):
        BlockPool(1, 1, 4, 4, torch.float32, num_blocks=8, memory_probe=probe)  # 8 x 128 bytes
    assert calls == [False]
    pool = BlockPool(1, 1, 4, 4, torch.float32, num_blocks=7, memory_probe=probe)  # 896 bytes fit
    assert pool.total_bytes == 896


def test_the_default_probe_reads_the_host():
    from pagedbench.refengine.kv.block_pool import available_memory_bytes

    avail = available_memory_bytes(False)
    assert avail is None or 0 < avail < 1 << 50


@pytest.mark.gpu
def test_the_gpu_probe_refuses_a_pool_larger_than_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    free = torch.cuda.mem_get_info()[0]
    with pytest.raises(InsufficientMemoryError, match="the GPU has"):
        BlockPool(1, 8, 128, 16, torch.float16, memory_bytes=2 * free)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident size is read from Linux's /proc")
@pytest.mark.parametrize("poison", [False, True])
def test_the_pool_is_resident_once_built(poison):
    # A lazily mapped (calloc'd) pool would fault on each page's first write inside the timed decode steps;
    # 2 x 96 MiB arrays are above glibc's mmap threshold, so they come as fresh, unmapped pages.
    before = _resident_bytes()
    pool = BlockPool(1, 4, 64, 16, torch.float32, num_blocks=6144, poison=poison)
    grown = _resident_bytes() - before
    assert grown >= 0.9 * pool.total_bytes, f"only {grown:,} of {pool.total_bytes:,} bytes are resident"
    assert bool(torch.isnan(pool.k(0)).all()) if poison else not bool(pool.k(0).any())
