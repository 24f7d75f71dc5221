"""A cache past 2^31 elements: every offset must be computed in 64 bits (vLLM #1486, #50427,
flash-attention #772 silently corrupted output when int32 offsets wrapped).

The caches are ``torch.empty`` (untouched pages cost no RAM); only the few blocks a test uses are
written, near the end of the cache (element offsets above 2^31) and at block 0. Each test records its
resident-memory growth across the call (``rss_growth_mib``), so an implementation that copies the cache
shows.
"""

from __future__ import annotations

import os
import resource

import pytest
import torch
from pagedbench.conformance import checks, oracle
from pagedbench.conformance.cases import TOLERANCES

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 1, 64
ELEMENTS_PER_BLOCK = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
NUM_BLOCKS = 2**31 // ELEMENTS_PER_BLOCK + 8  # 2^31 + 8192 elements per cache (4 GiB in float16)
DTYPE = torch.float16


def _rss_mib() -> float:
    """Resident memory of this process now (Linux ``/proc``; else the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture(scope="module")
def huge_caches(impl):
    """K and V caches of NUM_BLOCKS blocks on the implementation's device, uninitialised (shared by the
    tests of this module)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    try:
        return (torch.empty(shape, dtype=DTYPE, device=impl.device),
                torch.empty(shape, dtype=DTYPE, device=impl.device))
    except RuntimeError as e:  # pragma: no cover - a machine without the address space
        pytest.skip(f"cannot reserve two {NUM_BLOCKS * ELEMENTS_PER_BLOCK * 2 / 2**30:.1f} GiB caches: {e}")


def _random_block(gen: torch.Generator, device) -> torch.Tensor:
    return torch.randn(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(device)


def test_write_kv_past_2_31_elements(impl, huge_caches):
    """Slots whose element offset is above 2^31 (and slot 0) get exactly their tokens; the blocks
    around them are unchanged."""
    k_cache, v_cache = huge_caches
    gen = torch.Generator().manual_seed(31)
    last = NUM_BLOCKS - 1
    touched = [0, 1, last - 2, last - 1, last]
    for b in touched:  # known contents for the blocks we look at
        k_cache[b] = _random_block(gen, k_cache.device)
        v_cache[b] = _random_block(gen, k_cache.device)
    before_k = {b: k_cache[b].clone() for b in touched}
    before_v = {b: v_cache[b].clone() for b in touched}
    slots = [last * BLOCK_SIZE + 3, (last - 1) * BLOCK_SIZE, 5, last * BLOCK_SIZE + BLOCK_SIZE - 1]
    assert slots[0] * NUM_KV_HEADS * HEAD_DIM > 2**31  # the point of the test
    dev = k_cache.device
    k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(dev)
    v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(dev)
    rss = _rss_mib()
    impl.write_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device=dev))
    checks.record("rss_growth_mib", _rss_mib() - rss)
    for t, s in enumerate(slots):
        before_k[s // BLOCK_SIZE][s % BLOCK_SIZE] = k[t]
        before_v[s // BLOCK_SIZE][s % BLOCK_SIZE] = v[t]
    for b in touched:
        checks.assert_bitwise_equal(k_cache[b], before_k[b], what=f"k_cache[{b}]", context="write_kv/huge")
        checks.assert_bitwise_equal(v_cache[b], before_v[b], what=f"v_cache[{b}]", context="write_kv/huge")


def test_decode_reads_blocks_past_2_31_elements(impl, huge_caches):
    """A sequence whose blocks sit at the end of a huge cache (and at block 0) matches the oracle."""
    k_cache, v_cache = huge_caches
    gen = torch.Generator().manual_seed(32)
    last = NUM_BLOCKS - 1
    table = [last, 0, last - 2, last - 1]
    for b in table:
        k_cache[b] = _random_block(gen, k_cache.device)
        v_cache[b] = _random_block(gen, k_cache.device)
    seq_len = 3 * BLOCK_SIZE + 5
    q = (torch.randn(1, 2, HEAD_DIM, generator=gen) * 4).to(DTYPE)  # peaky: every key matters
    tables = torch.tensor([table], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    ref = oracle.decode(q, k_cache, v_cache, tables, lens)
    dev = k_cache.device
    q, tables, lens = q.to(dev), tables.to(dev), lens.to(dev)
    rss = _rss_mib()
    out = impl.paged_decode(q, k_cache, v_cache, tables, lens, out=torch.full_like(q, float("nan")))
    checks.record("rss_growth_mib", _rss_mib() - rss)
    tol = TOLERANCES[DTYPE]
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out",
                        context="decode/huge")
