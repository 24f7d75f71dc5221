"""The physical KV cache: one K slab and one V slab per layer, shared with torch zero-copy.

Layout (the same for K and V, one slab each per layer)::

    slab[layer]  shape [num_blocks, block_size, num_kv_heads, head_dim], C-contiguous

        block 0            block 1                    block num_blocks-1
      +----------------+ +----------------+         +----------------+
      | off 0 [Hkv, D] | | off 0 [Hkv, D] |   ...   | off 0 [Hkv, D] |
      | off 1 [Hkv, D] | | off 1 [Hkv, D] |         | off 1 [Hkv, D] |
      |  ...           | |  ...           |         |  ...           |
      | off bs-1       | | off bs-1       |         | off bs-1       |
      +----------------+ +----------------+         +----------------+

    slot = block_id * block_size + offset       (slab.reshape(num_slots, Hkv, D)[slot])

Memory comes from one array-module code path: ``xp = cupy`` when ``kernels.device.backend().is_gpu``,
``xp = numpy`` otherwise (this is the only module of ``refengine`` that meets CuPy, imported lazily on
the GPU path only). Neither NumPy nor CuPy has bfloat16, so each slab is allocated as an unsigned-int
array of the element's width (uint16 for fp16/bf16, uint32 for fp32, uint64 for fp64) and the torch
tensor made from it (``torch.from_dlpack`` for CuPy, ``torch.from_numpy`` for NumPy) is ``.view(dtype)``-ed.
The torch views are made once, at construction, and never copied: writing through a view is seen in
the array and vice versa (same ``data_ptr``).

Fresh memory is filled with NaN (``poison=True``, the default) so a read of a slot nobody wrote shows
up as NaN in attention output instead of passing silently as zeros; ``poison=False`` zero-fills.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from pagedbench.kernels import device as _device
from pagedbench.refengine.errors import InsufficientMemoryError, InvalidArgumentError

#: torch dtype -> (unsigned storage dtype name of the same width, NaN bit pattern)
_STORAGE: dict[torch.dtype, tuple[str, int]] = {
    torch.float16: ("uint16", 0x7E00),
    torch.bfloat16: ("uint16", 0x7FC0),
    torch.float32: ("uint32", 0x7FC0_0000),
    torch.float64: ("uint64", 0x7FF8_0000_0000_0000),
    # fp8 KV caches (NumPy has no fp8 dtype: bytes, viewed as float8_e4m3fn by torch); values are stored
    # quantized by the attention kernels' write_kv, not by write_slots
    torch.float8_e4m3fn: ("uint8", 0x7F),
}


def _array_module() -> tuple[Any, Any]:
    """``(xp, to_torch)`` for this process's backend: CuPy + DLPack on a GPU, NumPy + from_numpy on a CPU."""
    if _device.backend().is_gpu:
        try:
            import cupy  # the one place refengine meets CuPy
        except ImportError as e:
            raise ImportError(
                "the GPU backend keeps KV memory in CuPy, which is not installed: install the wheel matching "
                "your CUDA (e.g. `pip install cupy-cuda12x`, the `gpu` extra) or set PAGEDBENCH_DEVICE=cpu"
            ) from e
        cupy.cuda.Device(_device.backend().torch_device.index or 0).use()
        return cupy, torch.from_dlpack
    return np, torch.from_numpy


def available_memory_bytes(is_gpu: bool) -> int | None:
    """Memory the pool could take now: the GPU's free memory, or the host's ``MemAvailable``.

    None when it cannot be told (the check is then skipped)."""
    if is_gpu:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    return int(value)


class BlockPool:
    """The KV cache memory: ``num_layers`` x (K, V) slabs of ``num_blocks`` blocks (layout above).

    Size it with exactly one of ``num_blocks`` or ``memory_bytes`` (a budget, as vLLM sizes from
    ``gpu_memory_utilization``: ``num_blocks = memory_bytes // bytes_per_block``, where
    ``bytes_per_block`` counts every layer, K and V). ``device``, if given, must be the backend's device
    (the pool always lives where :func:`kernels.device.backend` says). Before allocating, the pool's
    size is checked against ``memory_probe(is_gpu)`` (default: the device's available memory).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float32, *, num_blocks: int | None = None,
                 memory_bytes: int | None = None, poison: bool = True,
                 device: str | torch.device | None = None,
                 memory_probe: Callable[[bool], int | None] = available_memory_bytes) -> None:
        self.num_layers = _positive_int("num_layers", num_layers)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.block_size = _positive_int("block_size", block_size)
        if dtype not in _STORAGE:
            names = ", ".join(str(d) for d in _STORAGE)
            raise InvalidArgumentError(f"dtype must be one of {names}; got {dtype!r}")
        self.dtype = dtype
        self.device = _device.backend().torch_device
        if device is not None and torch.device(device) != self.device:
            raise InvalidArgumentError(f"device must be the backend's {self.device}, got {device}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        #: bytes of one block across every layer, K and V
        per_layer = self.block_size * self.num_kv_heads * self.head_dim * itemsize
        self.bytes_per_block = 2 * self.num_layers * per_layer
        self.num_blocks = self._size(num_blocks, memory_bytes)
        self.total_bytes = self.num_blocks * self.bytes_per_block
        self.num_slots = self.num_blocks * self.block_size
        self.poison = bool(poison)
        # A pool larger than the memory there is would be killed by the OOM killer (host) or fail deep in
        # the allocator (GPU) after part of it was taken: refuse it up front, naming both sizes.
        available = memory_probe(_device.backend().is_gpu)
        if available is not None and self.total_bytes > available:
            where = "GPU" if _device.backend().is_gpu else "host"
            raise InsufficientMemoryError(
                f"the KV pool needs {self.total_bytes:,} bytes ({self.num_blocks} blocks x "
                f"{self.bytes_per_block:,} bytes) but the {where} has {available:,} bytes available")
        self._arrays, self._k, self._v = self._allocate()
        # Flat [num_slots, Hkv, D] views of the same memory, for slot writes.
        self._k_flat = [t.view(self.num_slots, self.num_kv_heads, self.head_dim) for t in self._k]
        self._v_flat = [t.view(self.num_slots, self.num_kv_heads, self.head_dim) for t in self._v]

    def _size(self, num_blocks: int | None, memory_bytes: int | None) -> int:
        if (num_blocks is None) == (memory_bytes is None):
            raise InvalidArgumentError(
                f"give exactly one of num_blocks or memory_bytes; got num_blocks={num_blocks!r}, "
                f"memory_bytes={memory_bytes!r}")
        if num_blocks is not None:
            return _positive_int("num_blocks", num_blocks)
        budget = _positive_int("memory_bytes", memory_bytes)
        if budget < self.bytes_per_block:
            raise InvalidArgumentError(
                f"memory_bytes={budget} is smaller than one block ({self.bytes_per_block} bytes: 2 x "
                f"{self.num_layers} layers x {self.block_size} slots x {self.num_kv_heads} heads x "
                f"{self.head_dim} x {self.dtype})")
        return budget // self.bytes_per_block

    def _allocate(self) -> tuple[list[tuple[Any, Any]], list[torch.Tensor], list[torch.Tensor]]:
        xp, to_torch = _array_module()
        storage, nan_bits = _STORAGE[self.dtype]
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        arrays, ks, vs = [], [], []
        for _ in range(self.num_layers):
            # Filled here, never left calloc'd: a lazily mapped pool takes a page fault (with transparent
            # huge pages, a 2 MiB zero-fill) on the first write to each page, inside the decode steps that
            # the engine is timed on, and the FIFO free list keeps handing out untouched blocks. vLLM's
            # torch.zeros pays the same fill at start-up.
            k_arr, v_arr = xp.empty(shape, dtype=storage), xp.empty(shape, dtype=storage)
            k_arr.fill(nan_bits if self.poison else 0)
            v_arr.fill(nan_bits if self.poison else 0)
            arrays.append((k_arr, v_arr))
            ks.append(to_torch(k_arr).view(self.dtype))
            vs.append(to_torch(v_arr).view(self.dtype))
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()  # the fill is done before torch's streams read
        return arrays, ks, vs

    # --- views ------------------------------------------------------------------------------------
    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise InvalidArgumentError(f"layer must be an int, got {type(layer).__name__} {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return int(layer)

    def k(self, layer: int) -> torch.Tensor:
        """Layer's K cache, ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``, zero-copy."""
        return self._k[self._layer(layer)]

    def v(self, layer: int) -> torch.Tensor:
        """Layer's V cache, ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype``, zero-copy."""
        return self._v[self._layer(layer)]

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(k, v)`` per layer: the same views as :meth:`k` / :meth:`v`."""
        return list(zip(self._k, self._v))

    def arrays(self, layer: int) -> tuple[Any, Any]:
        """The backing NumPy/CuPy arrays ``(k, v)`` of a layer (unsigned-int storage of the dtype's width)."""
        return self._arrays[self._layer(layer)]

    # --- operations -------------------------------------------------------------------------------
    def _block_ids(self, name: str, ids: Sequence[int]) -> None:
        for b in ids:
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
                raise InvalidArgumentError(f"{name} block id must be an int, got {type(b).__name__} {b!r}")
            if not 0 <= b < self.num_blocks:
                raise InvalidArgumentError(f"{name} block id must be in [0, {self.num_blocks}), got {b}")

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` for each pair, in every layer, K and V (copy-on-write).

        All sources are read before any destination is written (gather, then scatter). Every id is
        validated first; a repeated destination is rejected (its content would be ambiguous). On bad
        input nothing is written.
        """
        pairs = [tuple(p) for p in pairs]
        for p in pairs:
            if len(p) != 2:
                raise InvalidArgumentError(f"copy_blocks takes (src, dst) pairs, got {p!r}")
        if not pairs:
            return
        src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
        self._block_ids("src", src)
        self._block_ids("dst", dst)
        if len(set(dst)) != len(dst):
            dup = sorted({d for d in dst if dst.count(d) > 1})
            raise InvalidArgumentError(f"copy_blocks: destination blocks must be distinct, repeated: {dup}")
        src_t = torch.tensor(src, dtype=torch.int64, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=self.device)
        for k, v in zip(self._k, self._v):
            k[dst_t] = k[src_t]
            v[dst_t] = v[src_t]

    def write_slots(self, layer: int, slots: torch.Tensor | Sequence[int], k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """Write ``k[i]``, ``v[i]`` (``[n, num_kv_heads, head_dim]`` of ``dtype``) to slot ``slots[i]``.

        ``slots`` is an int tensor or sequence ``[n]``; ``slot = block_id * block_size + offset``. The
        padding slot ``-1`` is skipped (never written: it must not wrap to the last slot, vLLM #43810);
        any other slot outside ``[0, num_slots)`` or a repeated slot is an error, and nothing is written.
        """
        layer = self._layer(layer)
        slots_t = torch.as_tensor(slots, device=self.device)
        not_int = slots_t.is_floating_point() or slots_t.is_complex() or slots_t.dtype == torch.bool
        if slots_t.dim() != 1 or (slots_t.numel() and not_int):
            raise InvalidArgumentError(
                f"slots must be a 1-D int tensor, got shape {tuple(slots_t.shape)} of {slots_t.dtype}")
        n = slots_t.numel()
        expected = (n, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != expected or t.dtype != self.dtype or t.device != self.device:
                raise InvalidArgumentError(
                    f"{name} must be {list(expected)} {self.dtype} on {self.device}; got "
                    f"{list(t.shape)} {t.dtype} on {t.device}")
        if n == 0:
            return
        slots_t = slots_t.to(torch.int64)
        keep = slots_t != -1
        live = slots_t[keep]
        if live.numel():
            lo, hi = int(live.min()), int(live.max())
            if lo < 0 or hi >= self.num_slots:
                bad = lo if lo < 0 else hi
                raise InvalidArgumentError(
                    f"slot must be in [0, {self.num_slots}) or the padding slot -1, got {bad}")
            if torch.unique(live).numel() != live.numel():
                raise InvalidArgumentError("slots must be distinct (apart from the padding slot -1)")
        self._k_flat[layer][live] = k[keep]
        self._v_flat[layer][live] = v[keep]

    def read_sequence(self, layer: int, block_table: Sequence[int] | torch.Tensor,
                      num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V as dense copies ``[num_tokens, num_kv_heads, head_dim]`` of ``dtype``.

        ``block_table`` lists physical block ids in logical order; it must cover ``num_tokens`` tokens
        (``len(block_table) >= ceil(num_tokens / block_size)``); blocks past that are ignored.
        """
        layer = self._layer(layer)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        table = block_table.tolist() if isinstance(block_table, torch.Tensor) else list(block_table)
        needed = math.ceil(num_tokens / self.block_size)
        if len(table) < needed:
            raise InvalidArgumentError(
                f"block_table has {len(table)} blocks; {num_tokens} tokens need {needed} "
                f"(block_size {self.block_size})")
        table = table[:needed]
        self._block_ids("block_table", table)
        idx = torch.tensor(table, dtype=torch.int64, device=self.device)
        shape = (needed * self.block_size, self.num_kv_heads, self.head_dim)
        k = self._k[layer][idx].reshape(shape)[:num_tokens].clone()
        v = self._v[layer][idx].reshape(shape)[:num_tokens].clone()
        return k, v

    def __repr__(self) -> str:
        return (f"BlockPool(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device}, total_bytes={self.total_bytes})")
