"""The checks of the host-memory arguments of :class:`~pagedbench.refengine.engine.llm.LLM`
(``preemption_mode``, ``swap_space``, ``kv_offloading_size``): how many bytes each host pool gets, or
the error naming the bad value. Torch-free, so that the command line runs the engine's own rules
before it imports torch or loads a model."""

from __future__ import annotations

import os

from pagedbench.refengine.engine.swap_preemption import PREEMPTION_MODES
from pagedbench.refengine.errors import InsufficientMemoryError, InvalidArgumentError

GIB = 1 << 30


def available_host_memory_bytes() -> int | None:
    """The host memory free for a new allocation now: psutil's ``available`` when it is installed, else
    the free physical pages (``os.sysconf``); None when neither tells."""
    try:
        import psutil
    except ImportError:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return int(psutil.virtual_memory().available)


def checked_host_space_bytes(name: str, gib: object, available: int | None, *, also_bytes: int = 0,
                             also: str = "") -> int:
    """``gib`` (the argument ``name``, GiB, an int or float >= 0) in bytes, refused when it is not a finite
    number >= 0 or when it and ``also_bytes`` (another host pool, named ``also``) together are more than
    ``available`` bytes (None: not checked)."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number of GiB >= 0, got {type(gib).__name__} {gib!r}")
    if not gib >= 0 or gib == float("inf"):  # (NaN fails the first test)
        raise InvalidArgumentError(f"{name} must be a finite number of GiB >= 0, got {gib!r}")
    size = int(gib * GIB)
    if available is not None and size + also_bytes > available:
        beside = f" (beside {also}'s {also_bytes:,})" if also_bytes else ""
        raise InsufficientMemoryError(f"{name}={gib} GiB needs {size:,} bytes of host memory{beside} but "
                                      f"only {available:,} bytes are available")
    return size


def swap_space_bytes(preemption_mode: object, swap_space: object, allocator: str, tp: int) -> int:
    """The swap host pool's bytes: 0 unless ``preemption_mode`` is "swap" (``swap_space`` must still be a
    number of GiB >= 0, but only a pool that will be allocated is held against the host's memory), or
    InvalidArgumentError / InsufficientMemoryError."""
    if not isinstance(preemption_mode, str) or preemption_mode not in PREEMPTION_MODES:
        raise InvalidArgumentError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; "
                                   f"got {preemption_mode!r}")
    if preemption_mode != "swap":
        checked_host_space_bytes("swap_space", swap_space, None)
        return 0
    if allocator != "paged":
        raise InvalidArgumentError(f"preemption_mode='swap' needs the paged allocator, got allocator={allocator!r}")
    if tp > 1:
        # each rank's pool would need its own host pool and the swaps in the broadcast step
        raise InvalidArgumentError("preemption_mode='swap' is not supported with tensor_parallel_size > 1 yet; "
                                   "use preemption_mode='recompute'")
    return checked_host_space_bytes("swap_space", swap_space, available_host_memory_bytes())


def kv_offloading_bytes(kv_offloading_size: object, swap_bytes: int, allocator: str, prefix_caching: object,
                        tp: int) -> int:
    """The prefix cache's host tier in bytes (0: none), or InvalidArgumentError / InsufficientMemoryError;
    it and the swap pool (``swap_bytes``, 0 without swap preemption) must fit the host's available memory
    together."""
    size = checked_host_space_bytes("kv_offloading_size", kv_offloading_size, None)
    if not size:
        return 0
    if allocator != "paged" or not prefix_caching:
        raise InvalidArgumentError(f"kv_offloading_size={kv_offloading_size} is a host tier of the prefix cache: it "
                                   f"needs the paged allocator with enable_prefix_caching=True, got "
                                   f"allocator={allocator!r}, enable_prefix_caching={prefix_caching!r}")
    if tp > 1:
        # each rank's pool would need its own host tier and the copies in the broadcast step
        raise InvalidArgumentError("kv_offloading_size is not supported with tensor_parallel_size > 1 yet; "
                                   "use kv_offloading_size=0")
    return checked_host_space_bytes("kv_offloading_size", kv_offloading_size, available_host_memory_bytes(),
                                    also_bytes=swap_bytes, also="swap_space")
