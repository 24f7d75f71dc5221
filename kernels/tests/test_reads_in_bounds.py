"""The kernels read and write nothing past the end of their tensors: a tensor placed so that its last byte
ends a page followed by an inaccessible one faults (SIGSEGV) on any access beyond it. A masked load that
loses its mask reads padding lanes there, which no value check can see (the lanes are discarded); a lost
store mask writes past the output, where no value check looks.

Each kernel call runs in a forked child (:func:`_in_child`), so such a read fails the test with an
assertion naming the signal, instead of killing the test process; the values are checked in the parent.

Linux, host memory: the interpreter's loads dereference host pointers.
"""

from __future__ import annotations

import ctypes
import io
import math
import mmap
import os
import signal
import sys

import pytest
import torch
from pagedbench import kernels
from pagedbench.conformance.gate import oracle

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through libc")


class _Guarded:
    """A zeroed tensor whose storage ends exactly where an inaccessible page begins."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        page = mmap.PAGESIZE
        self.size = (nbytes + page - 1) // page * page + page
        self.buf = mmap.mmap(-1, self.size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.mprotect(ctypes.c_void_p(addr + self.size - page), page, 0) != 0:
            pytest.skip(f"mprotect failed: errno {ctypes.get_errno()}")
        start = self.size - page - nbytes
        self.tensor = torch.frombuffer(self.buf, dtype=dtype, count=torch.Size(shape).numel(), offset=start)
        self.tensor = self.tensor.view(shape)


def _in_child(call):
    """``call()`` in a forked child, its result (tensors) sent back through a pipe: a read past a guarded
    end kills the child, not this process, and is reported as a failed check."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_end)
        code = 0
        try:
            buf = io.BytesIO()
            torch.save(call(), buf)
            with os.fdopen(write_end, "wb") as f:
                f.write(buf.getvalue())
        except BaseException:
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        raise AssertionError(f"the call read or wrote past the end of a guarded tensor: it died on "
                             f"{signal.Signals(os.WTERMSIG(status)).name}")
    assert os.WEXITSTATUS(status) == 0, "the call raised in the child (run it in-process to see why)"
    return torch.load(io.BytesIO(data))


def test_attention_reads_no_block_table_entry_past_the_table():
    """One sequence filling its whole 3-entry table (48 keys): a key tile is a power of two (64 keys, or
    more), so it runs past the table, and the table loads must stay masked to the sequence's entries."""
    gen = torch.Generator().manual_seed(0)
    bs, hq, hkv, d, num_blocks = 16, 2, 1, 16, 6
    guarded = _Guarded((1, 3), torch.int32)
    guarded.tensor.copy_(torch.tensor([[3, 0, 5]], dtype=torch.int32))
    table = guarded.tensor
    k = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    v = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    lens = torch.tensor([3 * bs], dtype=torch.int32)
    q = torch.randn(1, hq, d, generator=gen)
    ref = oracle.decode(q, k, v, table.clone(), lens)
    out = _in_child(lambda: kernels.paged_decode(q, k, v, table, lens))
    torch.testing.assert_close(out.double(), ref.out, rtol=1e-5, atol=1e-5)
    qp = torch.randn(5, hq, d, generator=gen)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    ref = oracle.prefill(qp, k, v, table.clone(), lens, cu)
    out = _in_child(lambda: kernels.paged_prefill(qp, k, v, table, lens, cu))
    torch.testing.assert_close(out.double(), ref.out, rtol=1e-5, atol=1e-5)


def test_copy_blocks_reads_nothing_past_the_last_block():
    """Blocks of 120 elements (a tile of 128): copying the cache's last block must not read the 8 lanes
    past it."""
    shape = (3, 5, 1, 24)
    k, v = _Guarded(shape, torch.float32), _Guarded(shape, torch.float32)
    gen = torch.Generator().manual_seed(1)
    k.tensor.copy_(torch.randn(shape, generator=gen))
    v.tensor.copy_(torch.randn(shape, generator=gen))
    want_k, want_v = k.tensor.clone(), v.tensor.clone()
    want_k[0], want_v[0] = want_k[2].clone(), want_v[2].clone()
    def copy():
        kernels.copy_blocks(k.tensor, v.tensor, torch.tensor([[2, 0]]))
        return k.tensor.clone(), v.tensor.clone()

    got_k, got_v = _in_child(copy)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_write_kv_reads_no_slot_past_the_slot_mapping():
    """Three tokens (a token tile holds more): the slot loads must stay masked to the mapping's entries."""
    gen = torch.Generator().manual_seed(2)
    shape = (4, 4, 1, 8)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    slots = _Guarded((3,), torch.int64)
    slots.tensor.copy_(torch.tensor([5, 0, 14]))
    k, v = torch.randn(3, 1, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tensor.tolist()):
        want_k[s // 4, s % 4], want_v[s // 4, s % 4] = k[t], v[t]
    def write():
        kernels.write_kv(k, v, k_cache, v_cache, slots.tensor)
        return k_cache, v_cache

    got_k, got_v = _in_child(write)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


BS, HQ, HKV, D = 16, 6, 2, 24  # a group of 3 and a head_dim of 24: every tile has lanes past the data


def _guarded(t: torch.Tensor, keep: list) -> torch.Tensor:
    """A copy of ``t`` that ends where an inaccessible page begins (``keep`` holds its mapping)."""
    g = _Guarded(tuple(t.shape), t.dtype)
    g.tensor.copy_(t)
    keep.append(g)
    return g.tensor


def _attention_inputs(gen, keep, num_blocks: int, tables: list[list[int]], lens: list[int]):
    caches = [torch.randn(num_blocks, BS, HKV, D, generator=gen) for _ in range(2)]
    tables_t = torch.tensor(tables, dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    plain = (*caches, tables_t, lens_t)
    return plain, tuple(_guarded(t, keep) for t in plain)


@pytest.mark.parametrize("op", ["decode", "decode-splits", "prefill", "contiguous", "write_kv", "copy_blocks"])
def test_every_tensor_is_read_and_written_only_inside(op):
    """Each operation with *every* tensor argument (and ``out=``) ending where an inaccessible page begins:
    a lane past a row, a head past a group or a token past the last, read or written, kills the call."""
    gen, keep = torch.Generator().manual_seed(3), []
    if op in ("decode", "decode-splits", "prefill"):
        long = op == "decode-splits"  # 320 keys: two key tiles, so two splits and the reduction
        num_blocks = 24 if long else 6
        tables = [list(range(20)), list(range(4, 24))] if long else [[3, 0, 5], [1, 4, 2]]
        plain, (k, v, tables_g, lens_g) = _attention_inputs(gen, keep, num_blocks, tables, [300 if long else 40, 17])
        if op == "prefill":
            cu = torch.tensor([0, 5, 8], dtype=torch.int32)
            q = torch.randn(8, HQ, D, generator=gen)
            want = oracle.prefill(q, *plain, cu).out
            q_g, cu_g, out_g = _guarded(q, keep), _guarded(cu, keep), _guarded(torch.full_like(q, math.nan), keep)
            got = _in_child(lambda: kernels.paged_prefill(q_g, k, v, tables_g, lens_g, cu_g, out=out_g))
        else:
            q = torch.randn(2, HQ, D, generator=gen)
            want = oracle.decode(q, *plain).out
            q_g, out_g = _guarded(q, keep), _guarded(torch.full_like(q, math.nan), keep)
            splits = 2 if long else None
            got = _in_child(lambda: kernels.paged_decode(q_g, k, v, tables_g, lens_g, num_splits=splits, out=out_g))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    elif op == "contiguous":
        k, v = (torch.randn(2, 40, HKV, D, generator=gen) for _ in range(2))
        q, lens = torch.randn(2, HQ, D, generator=gen), torch.tensor([40, 17], dtype=torch.int32)
        want = oracle.decode(q, k, v, torch.arange(2, dtype=torch.int32)[:, None], lens).out
        args = [_guarded(t, keep) for t in (q, k, v, lens, torch.full_like(q, math.nan))]
        got = _in_child(lambda: kernels.contiguous_decode(*args[:4], out=args[4]))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    elif op == "write_kv":
        caches = [torch.randn(4, 5, HKV, D, generator=gen) for _ in range(2)]
        k, v = (torch.randn(5, HKV, D, generator=gen) for _ in range(2))
        slots = torch.tensor([7, 0, 19, 3, 12])
        want = [c.clone() for c in caches]
        for t, s in enumerate(slots.tolist()):
            want[0][s // 5, s % 5], want[1][s // 5, s % 5] = k[t], v[t]
        k_g, v_g, kc, vc, slots_g = (_guarded(t, keep) for t in (k, v, *caches, slots))
        got = _in_child(lambda: (kernels.write_kv(k_g, v_g, kc, vc, slots_g), kc, vc)[1:])
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    else:
        caches = [torch.randn(6, 5, HKV, D, generator=gen) for _ in range(2)]  # blocks of 240 elements
        pairs = torch.tensor([[2, 0], [5, 1]])
        want = [c.clone() for c in caches]
        for src, dst in pairs.tolist():
            want[0][dst], want[1][dst] = want[0][src].clone(), want[1][src].clone()
        kc, vc, pairs_g = (_guarded(t, keep) for t in (*caches, pairs))
        got = _in_child(lambda: (kernels.copy_blocks(kc, vc, pairs_g), kc, vc)[1:])
        assert all(torch.equal(g, w) for g, w in zip(got, want))
