"""The host tier of swap preemption: a host block pool (KV memory) and its block allocator.

The host pool has the device pool's block shape (``[num_blocks, block_size, num_kv_heads, head_dim]``
per layer, K and V, same dtype) in host memory: plain torch CPU tensors, pinned when CUDA is there so
device<->host copies run at full PCIe speed. On the CPU machine the device pool is host memory too,
but the two are separate arrays. It is left unfilled: a host block is always written by a swap-out
before a swap-in reads it, so nothing reads memory nobody wrote.

The allocator hands host block ids out and takes them back; it knows nothing of sequences (the
scheduler holds which host blocks a swapped group owns). It is FIFO, like the device's uncached queue.
"""

from __future__ import annotations

from collections import deque

import torch
from pagedbench.refengine.errors import InsufficientMemoryError, InvalidArgumentError


class HostBlockPool:
    """``num_blocks`` host blocks of the shape and dtype of ``device_pool``'s (a BlockPool)."""

    def __init__(self, device_pool, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = device_pool.block_size
        self.bytes_per_block = device_pool.bytes_per_block
        self.total_bytes = num_blocks * self.bytes_per_block
        shape = (num_blocks, device_pool.block_size, device_pool.num_kv_heads, device_pool.head_dim)
        pin = torch.cuda.is_available() and num_blocks > 0
        self._k = [torch.empty(shape, dtype=device_pool.dtype, pin_memory=pin) for _ in range(device_pool.num_layers)]
        self._v = [torch.empty(shape, dtype=device_pool.dtype, pin_memory=pin) for _ in range(device_pool.num_layers)]

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(k, v)`` per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]`` on the CPU."""
        return list(zip(self._k, self._v))


class HostBlockAllocator:
    """Free host block ids, FIFO. Invariant: every id in ``[0, num_blocks)`` is either free (once) or
    held by exactly one swapped group; :meth:`release` of an id already free is an error."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free host block ids; raises InsufficientMemoryError (nothing taken) when fewer are free."""
        if n > len(self._free):
            raise InsufficientMemoryError(f"{n} host blocks wanted, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
        return ids

    def release(self, ids: list[int]) -> None:
        seen: set[int] = set()
        for i in ids:
            if self._is_free[i] or i in seen:  # a duplicate id would sit in the free list twice
                raise AssertionError(f"host block {i} released twice")
            seen.add(i)
        for i in ids:
            self._is_free[i] = True
        self._free.extend(ids)
