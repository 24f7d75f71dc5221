"""A cache past 2^31 elements: every offset must be computed in 64 bits (vLLM #1486, #50427,
flash-attention #772 silently corrupted output when int32 offsets wrapped).

The caches are ``torch.empty`` (untouched pages cost no RAM); only the few blocks a test uses are
written, near the end of the cache (element offsets above 2^31) and at block 0. Each test records its
resident-memory growth across the call (``rss_growth_mib``), so an implementation that copies the cache
shows.

On the CPU each cache starts ``WRAP_GUARD_ELEMENTS`` (2^31) elements into its allocation. An offset
formed in 32 bits wraps to ``true - 2^32``, at least ``-2^31`` here: the wrapped access lands inside
that guard (reserved, never written by a correct implementation), so an int32 offset fails the value
checks below with an assertion instead of killing the process with a SIGSEGV at an unmapped address.
On a GPU the guard would cost 8 GiB of device memory, so there a wrapped offset faults instead (an
illegal address, which the gate records as a crash).
"""

from __future__ import annotations

import pytest
import torch
from pagedbench.conformance.gate import checks, oracle, resident_memory
from pagedbench.conformance.gate.cases import TOLERANCES

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 16, 1, 64
ELEMENTS_PER_BLOCK = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
NUM_BLOCKS = 2**31 // ELEMENTS_PER_BLOCK + 8  # 2^31 + 8192 elements per cache (4 GiB in float16)
DTYPE = torch.float16
WRAP_GUARD_ELEMENTS = 2**31


_rss_mib = resident_memory.rss_mib


@pytest.fixture(scope="module")
def huge_caches(impl):
    """K and V caches of NUM_BLOCKS blocks on the implementation's device, uninitialised (shared by the
    tests of this module)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    guard = WRAP_GUARD_ELEMENTS if torch.device(impl.device).type == "cpu" else 0
    size = NUM_BLOCKS * ELEMENTS_PER_BLOCK

    def cache() -> torch.Tensor:
        return torch.empty(guard + size, dtype=DTYPE, device=impl.device)[guard:].view(shape)

    try:
        return cache(), cache()
    except RuntimeError as e:  # pragma: no cover - a machine without the address space
        pytest.skip(f"cannot reserve two {(guard + size) * 2 / 2**30:.1f} GiB caches: {e}")


def _random_block(gen: torch.Generator, device) -> torch.Tensor:
    return torch.randn(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(device)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_past_2_31_elements(impl, huge_caches, slot_dtype):
    """Slots whose element offset is above 2^31 (and slot 0) get exactly their tokens; the blocks
    around them are unchanged. With int32 slots the slot fits, but slot x elements-per-slot does not:
    the product must be formed in 64 bits."""
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
    impl.write_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=slot_dtype, device=dev))
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
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context="decode/huge")


def test_prefill_reads_blocks_past_2_31_elements(impl, huge_caches):
    """Prefill queries of a sequence whose blocks sit at the end of a huge cache (and at block 0)."""
    k_cache, v_cache = huge_caches
    gen = torch.Generator().manual_seed(33)
    last = NUM_BLOCKS - 1
    table = [last - 1, 0, last, last - 2]
    for b in table:
        k_cache[b] = _random_block(gen, k_cache.device)
        v_cache[b] = _random_block(gen, k_cache.device)
    seq_len, q_len = 3 * BLOCK_SIZE + 5, 2 * BLOCK_SIZE + 1  # the queries cross two block boundaries
    q = (torch.randn(q_len, 2, HEAD_DIM, generator=gen) * 4).to(DTYPE)
    tables = torch.tensor([table], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    cu = torch.tensor([0, q_len], dtype=torch.int32)
    ref = oracle.prefill(q, k_cache, v_cache, tables, lens, cu)
    dev = k_cache.device
    q, tables, lens, cu = q.to(dev), tables.to(dev), lens.to(dev), cu.to(dev)
    rss = _rss_mib()
    out = impl.paged_prefill(q, k_cache, v_cache, tables, lens, cu, out=torch.full_like(q, float("nan")))
    checks.record("rss_growth_mib", _rss_mib() - rss)
    tol = TOLERANCES[DTYPE]
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context="prefill/huge")


@pytest.mark.parametrize("pair_dtype", [torch.int64, torch.int32])
def test_copy_blocks_past_2_31_elements(impl, huge_caches, pair_dtype):
    """Copies from and to blocks whose element offset is above 2^31, with block ids that fit int32
    (the id x block stride product must not)."""
    k_cache, v_cache = huge_caches
    gen = torch.Generator().manual_seed(34)
    last = NUM_BLOCKS - 1
    touched = [0, 1, last - 1, last]
    for b in touched:
        k_cache[b] = _random_block(gen, k_cache.device)
        v_cache[b] = _random_block(gen, k_cache.device)
    want_k = {b: k_cache[b].clone() for b in touched}
    want_v = {b: v_cache[b].clone() for b in touched}
    pairs = [(last, 1), (0, last - 1)]
    for src, dst in pairs:
        want_k[dst], want_v[dst] = want_k[src].clone(), want_v[src].clone()
    rss = _rss_mib()
    impl.copy_blocks(k_cache, v_cache, torch.tensor(pairs, dtype=pair_dtype, device=k_cache.device))
    checks.record("rss_growth_mib", _rss_mib() - rss)
    for b in touched:
        checks.assert_bitwise_equal(k_cache[b], want_k[b], what=f"k_cache[{b}]", context="copy_blocks/huge")
        checks.assert_bitwise_equal(v_cache[b], want_v[b], what=f"v_cache[{b}]", context="copy_blocks/huge")


def test_contiguous_decode_past_2_31_elements(impl, huge_caches):
    """Contiguous K/V whose sequence stride fits int32 (2^30 + 1024 elements) but whose third sequence
    starts past 2^31 elements: a view over the huge cache's storage, so nothing more is allocated."""
    k_cache, v_cache = huge_caches
    gen = torch.Generator().manual_seed(35)
    seq_stride, max_len = 2**30 + 1024, 2 * BLOCK_SIZE
    shape = (3, max_len, NUM_KV_HEADS, HEAD_DIM)
    strides = (seq_stride, NUM_KV_HEADS * HEAD_DIM, HEAD_DIM, 1)
    k = k_cache.view(-1).as_strided(shape, strides)
    v = v_cache.view(-1).as_strided(shape, strides)
    assert 2 * seq_stride + k[2].numel() <= k_cache.numel() and 2 * seq_stride > 2**31
    lens = torch.tensor([3, 1, max_len - 3], dtype=torch.int32)
    for s, n in enumerate(lens.tolist()):
        k[s, :n] = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(k.device)
        v[s, :n] = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(k.device)
    q = (torch.randn(3, 2, HEAD_DIM, generator=gen) * 4).to(DTYPE)
    # the oracle sees the same K/V as a paged cache: sequence s is one block of max_len slots
    paged_k = torch.stack([k[s] for s in range(3)]).cpu()
    paged_v = torch.stack([v[s] for s in range(3)]).cpu()
    ref = oracle.decode(q, paged_k, paged_v, torch.arange(3, dtype=torch.int32)[:, None], lens)
    dev = k.device
    q, lens = q.to(dev), lens.to(dev)
    rss = _rss_mib()
    out = impl.contiguous_decode(q, k, v, lens, out=torch.full_like(q, float("nan")))
    checks.record("rss_growth_mib", _rss_mib() - rss)
    tol = TOLERANCES[DTYPE]
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context="contiguous/huge")


HEAD_STRIDE = 2**30 + 1024  # fits int32; twice it does not
NUM_VIEW_BLOCKS, NUM_VIEW_KV_HEADS = 6, 3


def _head_strided(cache: torch.Tensor) -> torch.Tensor:
    """The first blocks of a huge cache seen as 3 KV heads HEAD_STRIDE elements apart: the third head's
    rows start past 2^31 elements (a view, nothing allocated; its last element is the cache's last)."""
    shape = (NUM_VIEW_BLOCKS, BLOCK_SIZE, NUM_VIEW_KV_HEADS, HEAD_DIM)
    view = cache.view(-1).as_strided(shape, (ELEMENTS_PER_BLOCK, HEAD_DIM, HEAD_STRIDE, 1))
    last = (NUM_VIEW_BLOCKS - 1) * ELEMENTS_PER_BLOCK + (BLOCK_SIZE - 1) * HEAD_DIM + 2 * HEAD_STRIDE + HEAD_DIM - 1
    assert 2 * HEAD_STRIDE > 2**31 and last < cache.numel()
    return view


@pytest.mark.parametrize("op", ["decode", "prefill", "write_kv", "copy_blocks"])
def test_kv_heads_past_2_31_elements(impl, huge_caches, op):
    """Caches whose KV-head stride fits int32 but whose third head starts past 2^31 elements: the head
    index times the head stride must be formed in 64 bits too (the KV head a program works on; the head
    of a flattened (head, dim) element in the cache writes)."""
    k_cache, v_cache = (_head_strided(c) for c in huge_caches)
    gen = torch.Generator().manual_seed(36)
    dev = k_cache.device
    for c in (k_cache, v_cache):
        c[:] = torch.randn(c.shape, generator=gen).to(DTYPE).to(dev)
    num_heads = 2 * NUM_VIEW_KV_HEADS
    tol = TOLERANCES[DTYPE]
    tables = torch.tensor([[3, 0, 5]], dtype=torch.int32)
    lens = torch.tensor([2 * BLOCK_SIZE + 7], dtype=torch.int32)
    if op == "decode":
        q = (torch.randn(1, num_heads, HEAD_DIM, generator=gen) * 4).to(DTYPE)
        ref = oracle.decode(q, k_cache, v_cache, tables, lens)
        q, out = q.to(dev), torch.full_like(q, float("nan")).to(dev)
        out = impl.paged_decode(q, k_cache, v_cache, tables.to(dev), lens.to(dev), out=out)
        checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context="decode/heads")
    elif op == "prefill":
        q_len = BLOCK_SIZE + 3
        q = (torch.randn(q_len, num_heads, HEAD_DIM, generator=gen) * 4).to(DTYPE)
        cu = torch.tensor([0, q_len], dtype=torch.int32)
        ref = oracle.prefill(q, k_cache, v_cache, tables, lens, cu)
        q, out = q.to(dev), torch.full_like(q, float("nan")).to(dev)
        out = impl.paged_prefill(q, k_cache, v_cache, tables.to(dev), lens.to(dev), cu.to(dev), out=out)
        checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context="prefill/heads")
    elif op == "write_kv":
        slots = [5 * BLOCK_SIZE + 2, 0, 3 * BLOCK_SIZE + BLOCK_SIZE - 1]
        k = torch.randn(len(slots), NUM_VIEW_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(dev)
        v = torch.randn(len(slots), NUM_VIEW_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(dev)
        want_k, want_v = k_cache.clone(), v_cache.clone()
        for t, s in enumerate(slots):
            want_k[s // BLOCK_SIZE, s % BLOCK_SIZE], want_v[s // BLOCK_SIZE, s % BLOCK_SIZE] = k[t], v[t]
        impl.write_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device=dev))
        checks.assert_bitwise_equal(k_cache, want_k, what="k_cache", context="write_kv/heads")
        checks.assert_bitwise_equal(v_cache, want_v, what="v_cache", context="write_kv/heads")
    else:
        pairs = [(5, 1), (0, 4)]
        want_k, want_v = k_cache.clone(), v_cache.clone()
        for src, dst in pairs:
            want_k[dst], want_v[dst] = want_k[src].clone(), want_v[src].clone()
        impl.copy_blocks(k_cache, v_cache, torch.tensor(pairs, dtype=torch.int64, device=dev))
        checks.assert_bitwise_equal(k_cache, want_k, what="k_cache", context="copy_blocks/heads")
        checks.assert_bitwise_equal(v_cache, want_v, what="v_cache", context="copy_blocks/heads")


TOKEN_STRIDE = 2**30 + 1024  # fits int32; twice it does not


def test_write_kv_tokens_past_2_31_elements(impl, huge_caches):
    """Tokens of ``k``/``v`` TOKEN_STRIDE elements apart, the third past 2^31 elements (views over the
    huge caches' own storage, away from the slots written): the token index times the token stride must
    be formed in 64 bits."""
    k_cache, v_cache = huge_caches
    gen = torch.Generator().manual_seed(37)
    dev = k_cache.device
    shape, strides = (3, NUM_KV_HEADS, HEAD_DIM), (TOKEN_STRIDE, HEAD_DIM, 1)
    k, v = (c.view(-1).as_strided(shape, strides) for c in huge_caches)
    last = NUM_BLOCKS - 1
    touched = [1, 2, last]
    for b in touched:
        k_cache[b] = _random_block(gen, dev)
        v_cache[b] = _random_block(gen, dev)
    for t in range(3):
        k[t] = torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(dev)
        v[t] = torch.randn(NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(dev)
    assert 2 * TOKEN_STRIDE > 2**31 and (2 * TOKEN_STRIDE) // ELEMENTS_PER_BLOCK not in touched
    slots = [BLOCK_SIZE + 3, last * BLOCK_SIZE + 5, 2 * BLOCK_SIZE]
    want_k = {b: k_cache[b].clone() for b in touched}
    want_v = {b: v_cache[b].clone() for b in touched}
    for t, s in enumerate(slots):
        want_k[s // BLOCK_SIZE][s % BLOCK_SIZE], want_v[s // BLOCK_SIZE][s % BLOCK_SIZE] = k[t], v[t]
    impl.write_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device=dev))
    for b in touched:
        checks.assert_bitwise_equal(k_cache[b], want_k[b], what=f"k_cache[{b}]", context="write_kv/tokens")
        checks.assert_bitwise_equal(v_cache[b], want_v[b], what=f"v_cache[{b}]", context="write_kv/tokens")


def _token_strided(cache: torch.Tensor, num_tokens: int, row: int, first: int = 0) -> torch.Tensor:
    """``num_tokens`` rows of ``row`` elements TOKEN_STRIDE apart over the huge cache's own storage,
    starting ``first`` elements in: the third row starts past 2^31 elements (a view, nothing allocated)."""
    assert first + (num_tokens - 1) * TOKEN_STRIDE + row <= cache.numel()
    return cache.view(-1).as_strided((num_tokens, row), (TOKEN_STRIDE, 1), cache.storage_offset() + first)


def _blocks_under(view_rows: list[int], row: int) -> set[int]:
    """The cache blocks that rows starting at these element offsets (``row`` elements long) overlap."""
    return {b for s in view_rows for b in range(s // ELEMENTS_PER_BLOCK, (s + row - 1) // ELEMENTS_PER_BLOCK + 1)}


def test_prefill_query_tokens_past_2_31_elements(impl, huge_caches):
    """Query and output tokens TOKEN_STRIDE elements apart, the third past 2^31 elements (views over the
    caches' storage, away from the blocks the sequence reads): the query token index times the q/out
    token stride must be formed in 64 bits, for the loads of q and the stores of out alike."""
    k_cache, v_cache = huge_caches
    gen = torch.Generator().manual_seed(38)
    dev = k_cache.device
    num_heads, q_len = 2 * NUM_KV_HEADS, 3
    row = num_heads * HEAD_DIM
    last = NUM_BLOCKS - 1
    table = [last, 3, last - 2, 5]
    starts = [t * TOKEN_STRIDE for t in range(q_len)]
    out_starts = [s + row for s in starts]
    assert starts[2] > 2**31 and not _blocks_under(starts + out_starts, row) & set(table)
    for b in table:
        k_cache[b] = _random_block(gen, dev)
        v_cache[b] = _random_block(gen, dev)
    q = _token_strided(k_cache, q_len, row).view(q_len, num_heads, HEAD_DIM)
    q.copy_((torch.randn(q_len, num_heads, HEAD_DIM, generator=gen) * 4).to(DTYPE))  # peaky
    out = _token_strided(k_cache, q_len, row, first=row).view(q_len, num_heads, HEAD_DIM)
    out.fill_(float("nan"))
    seq_len = 3 * BLOCK_SIZE + 5
    tables = torch.tensor([table], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    cu = torch.tensor([0, q_len], dtype=torch.int32)
    ref = oracle.prefill(q.cpu(), k_cache, v_cache, tables, lens, cu)
    got = impl.paged_prefill(q, k_cache, v_cache, tables.to(dev), lens.to(dev), cu.to(dev), out=out)
    tol = TOLERANCES[DTYPE]
    checks.check_tensor(got, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context="prefill/tokens")
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out=", context="prefill/tokens")


def test_contiguous_decode_positions_past_2_31_elements(impl, huge_caches):
    """One contiguous sequence whose positions are TOKEN_STRIDE elements apart, its third key and value
    past 2^31 elements (views over the caches' storage): the position times the position stride must be
    formed in 64 bits."""
    gen = torch.Generator().manual_seed(39)
    dev = huge_caches[0].device
    max_len = 3
    row = NUM_KV_HEADS * HEAD_DIM
    k, v = (_token_strided(c, max_len, row).view(1, max_len, NUM_KV_HEADS, HEAD_DIM) for c in huge_caches)
    assert (max_len - 1) * k.stride(1) > 2**31
    for c in (k, v):
        c.copy_(torch.randn(c.shape, generator=gen).to(DTYPE))
    q = (torch.randn(1, 2, HEAD_DIM, generator=gen) * 4).to(DTYPE)  # peaky: every key matters
    lens = torch.tensor([max_len], dtype=torch.int32)
    ref = oracle.decode(q, k.cpu().contiguous(), v.cpu().contiguous(), torch.zeros(1, 1, dtype=torch.int32), lens)
    out = impl.contiguous_decode(q.to(dev), k, v, lens.to(dev), out=torch.full_like(q, float("nan")).to(dev))
    tol = TOLERANCES[DTYPE]
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out",
                        context="contiguous/positions")


INDEX_STRIDE = 2**30 + 1024  # in int32 elements: fits int32; twice it does not


@pytest.fixture(scope="module")
def huge_index(impl):
    """A flat int32 tensor of 2 * INDEX_STRIDE + 4 elements (8 GiB, uninitialised) on the implementation's
    device, for block tables and copy pairs whose rows or columns lie INDEX_STRIDE elements apart. On the
    CPU it starts WRAP_GUARD_ELEMENTS into its allocation, as the caches do: an index times its stride
    formed in 32 bits reads that reserved, never written guard instead of an unmapped address."""
    guard = WRAP_GUARD_ELEMENTS if torch.device(impl.device).type == "cpu" else 0
    size = 2 * INDEX_STRIDE + 4
    try:
        return torch.empty(guard + size, dtype=torch.int32, device=impl.device)[guard:]
    except RuntimeError as e:  # pragma: no cover - a machine without the address space
        pytest.skip(f"cannot reserve a {(guard + size) * 4 / 2**30:.1f} GiB index tensor: {e}")


def _small_caches(gen: torch.Generator, device, num_blocks: int = 8):
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return tuple(torch.randn(shape, generator=gen).to(DTYPE).to(device) for _ in range(2))


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("layout", ["columns", "rows"])
def test_block_tables_past_2_31_elements(impl, huge_index, layout, op):
    """Block tables whose columns (or rows) are INDEX_STRIDE elements apart, the third past 2^31 elements
    (a view over the huge index tensor): the logical block index times the column stride, and the
    sequence index times the row stride, must be formed in 64 bits (a wrapped one reads the guard's 0
    and attends block 0 instead)."""
    gen = torch.Generator().manual_seed(40)
    dev = huge_index.device
    k_cache, v_cache = _small_caches(gen, dev)
    ids = torch.tensor([[3, 6, 5]]) if layout == "columns" else torch.tensor([[3, 6, 5], [1, 4, 2], [7, 5, 6]])
    strides = (1, INDEX_STRIDE) if layout == "columns" else (INDEX_STRIDE, 1)
    tables = huge_index.as_strided(ids.shape, strides, huge_index.storage_offset())
    tables.copy_(ids.to(torch.int32))
    assert 2 * INDEX_STRIDE > 2**31
    num_seqs = ids.shape[0]
    lens = torch.tensor([2 * BLOCK_SIZE + 7, 3 * BLOCK_SIZE, 2 * BLOCK_SIZE + 1][:num_seqs], dtype=torch.int32)
    cpu_tables = tables.cpu()
    tol = TOLERANCES[DTYPE]
    if op == "decode":
        q = (torch.randn(num_seqs, 2, HEAD_DIM, generator=gen) * 4).to(DTYPE)
        ref = oracle.decode(q, k_cache.cpu(), v_cache.cpu(), cpu_tables, lens)
        out = impl.paged_decode(q.to(dev), k_cache, v_cache, tables, lens.to(dev),
                                out=torch.full_like(q, float("nan")).to(dev))
    else:
        q_len = BLOCK_SIZE + 3
        q = (torch.randn(num_seqs * q_len, 2, HEAD_DIM, generator=gen) * 4).to(DTYPE)
        cu = torch.arange(num_seqs + 1, dtype=torch.int32) * q_len
        ref = oracle.prefill(q, k_cache.cpu(), v_cache.cpu(), cpu_tables, lens, cu)
        out = impl.paged_prefill(q.to(dev), k_cache, v_cache, tables, lens.to(dev), cu.to(dev),
                                 out=torch.full_like(q, float("nan")).to(dev))
    context = f"{op}/table-{layout}"
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context=context)


def test_copy_pairs_past_2_31_elements(impl, huge_index):
    """Copy pairs INDEX_STRIDE elements apart, the third pair past 2^31 elements (a view over the huge
    index tensor): the pair index times the pair stride must be formed in 64 bits (a wrapped one reads
    the guard's (0, 0) and leaves block 6 as it was)."""
    gen = torch.Generator().manual_seed(41)
    dev = huge_index.device
    k_cache, v_cache = _small_caches(gen, dev)
    pairs = huge_index.as_strided((3, 2), (INDEX_STRIDE, 1), huge_index.storage_offset())
    pairs.copy_(torch.tensor([[1, 4], [2, 5], [3, 6]], dtype=torch.int32))
    assert 2 * pairs.stride(0) > 2**31
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for src, dst in pairs.tolist():
        want_k[dst], want_v[dst] = want_k[src].clone(), want_v[src].clone()
    impl.copy_blocks(k_cache, v_cache, pairs)
    checks.assert_bitwise_equal(k_cache, want_k, what="k_cache", context="copy_blocks/pairs")
    checks.assert_bitwise_equal(v_cache, want_v, what="v_cache", context="copy_blocks/pairs")


OFFSET_STRIDE = 2**30 + 1024  # fits int32; twice it does not
NUM_OFFSET_BLOCKS, OFFSET_BLOCK_SIZE = 8, 3


def _offset_strided(cache: torch.Tensor) -> torch.Tensor:
    """The start of a huge cache seen as NUM_OFFSET_BLOCKS blocks of OFFSET_BLOCK_SIZE slots whose slots
    lie OFFSET_STRIDE elements apart (blocks interleaved, HEAD_DIM apart): each block's third slot starts
    past 2^31 elements (a view, nothing allocated)."""
    shape = (NUM_OFFSET_BLOCKS, OFFSET_BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    strides = (NUM_KV_HEADS * HEAD_DIM, OFFSET_STRIDE, HEAD_DIM, 1)
    last = (NUM_OFFSET_BLOCKS - 1) * strides[0] + (OFFSET_BLOCK_SIZE - 1) * OFFSET_STRIDE + strides[0] - 1
    assert NUM_OFFSET_BLOCKS * strides[0] <= OFFSET_STRIDE and last < cache.numel()
    return cache.view(-1).as_strided(shape, strides, cache.storage_offset())


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_block_offsets_past_2_31_elements(impl, huge_caches, op):
    """Caches whose slots within a block lie OFFSET_STRIDE elements apart: a slot's offset in its block
    times that stride must be formed in 64 bits (a wrapped one reads the guard in place of every block's
    third slot)."""
    k_cache, v_cache = (_offset_strided(c) for c in huge_caches)
    gen = torch.Generator().manual_seed(42)
    dev = k_cache.device
    for c in (k_cache, v_cache):
        c.copy_(torch.randn(c.shape, generator=gen).to(DTYPE))
    assert (OFFSET_BLOCK_SIZE - 1) * k_cache.stride(1) > 2**31
    tables = torch.tensor([[5, 0, 7]], dtype=torch.int32)
    lens = torch.tensor([3 * OFFSET_BLOCK_SIZE - 1], dtype=torch.int32)
    tol = TOLERANCES[DTYPE]
    if op == "decode":
        q = (torch.randn(1, 2, HEAD_DIM, generator=gen) * 4).to(DTYPE)
        ref = oracle.decode(q, k_cache, v_cache, tables, lens)
        out = impl.paged_decode(q.to(dev), k_cache, v_cache, tables.to(dev), lens.to(dev),
                                out=torch.full_like(q, float("nan")).to(dev))
    else:
        q_len = 2 * OFFSET_BLOCK_SIZE
        q = (torch.randn(q_len, 2, HEAD_DIM, generator=gen) * 4).to(DTYPE)
        cu = torch.tensor([0, q_len], dtype=torch.int32)
        ref = oracle.prefill(q, k_cache, v_cache, tables, lens, cu)
        out = impl.paged_prefill(q.to(dev), k_cache, v_cache, tables.to(dev), lens.to(dev), cu.to(dev),
                                 out=torch.full_like(q, float("nan")).to(dev))
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context=f"{op}/offsets")


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("layout", ["sequences", "heads"])
def test_decode_output_rows_past_2_31_elements(impl, huge_caches, layout, num_splits):
    """``out=`` whose sequences (or query heads) lie TOKEN_STRIDE elements apart, the third past 2^31
    elements (a view over a huge cache's storage): the sequence and head indices of the stores, in the
    split kernel and in the reduction that merges two splits, must be formed in 64 bits."""
    if not impl.capabilities.supports_num_splits:
        pytest.skip(f"not supported: {impl.name} does not support num_splits")
    gen = torch.Generator().manual_seed(43)
    dev = huge_caches[0].device
    num_blocks = 20  # 320 keys: two key tiles, so two splits
    k_cache, v_cache = _small_caches(gen, dev, num_blocks)
    num_seqs, num_heads = (3, 2) if layout == "sequences" else (1, 3)
    strides = (TOKEN_STRIDE, HEAD_DIM, 1) if layout == "sequences" else (3 * HEAD_DIM, TOKEN_STRIDE, 1)
    out = huge_caches[0].view(-1).as_strided((num_seqs, num_heads, HEAD_DIM), strides,
                                             huge_caches[0].storage_offset())
    assert 2 * TOKEN_STRIDE > 2**31
    out.fill_(float("nan"))
    tables = torch.stack([torch.randperm(num_blocks, generator=gen) for _ in range(num_seqs)]).to(torch.int32)
    lens = torch.tensor([300, 290, 310][:num_seqs], dtype=torch.int32)
    q = (torch.randn(num_seqs, num_heads, HEAD_DIM, generator=gen) * 4).to(DTYPE)
    ref = oracle.decode(q, k_cache.cpu(), v_cache.cpu(), tables, lens)
    got = impl.paged_decode(q.to(dev), k_cache, v_cache, tables.to(dev), lens.to(dev), num_splits=num_splits,
                            out=out)
    tol = TOLERANCES[DTYPE]
    context = f"decode/out-{layout},splits={num_splits}"
    checks.check_tensor(got, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context=context)
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out=", context=context)
