"""The kernels read nothing past the end of their inputs: a block table or a cache placed so that its last
byte ends a page followed by an inaccessible one faults (SIGSEGV) on any read beyond it. A masked load
that loses its mask reads padding lanes there, which no value check can see (the lanes are discarded).

Each kernel call runs in a forked child (:func:`_in_child`), so such a read fails the test with an
assertion naming the signal, instead of killing the test process; the values are checked in the parent.

Linux, host memory: the interpreter's loads dereference host pointers.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import signal
import sys

import pytest
import torch
from pagedbench import kernels
from pagedbench.conformance import oracle

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
        raise AssertionError(f"the call read past the end of a guarded input: it died on "
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
