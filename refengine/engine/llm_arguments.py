"""The checks of :class:`~pagedbench.refengine.engine.llm.LLM`'s arguments that need more than a line,
and the names of the values they take: every argument is checked before the model loads or a pool is
allocated, so a bad one costs nothing and changes nothing."""

from __future__ import annotations

import os

import torch
from pagedbench.refengine.engine.scheduler import Scheduler
from pagedbench.refengine.engine.swap_preemption import PREEMPTION_MODES as SWAP_PREEMPTION_MODES
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.kv.host_pool import (
    available_host_memory_bytes,
    checked_host_space_bytes,
    checked_swap_space_bytes,
)
from pagedbench.refengine.model.loader import LoadedModel

ALLOCATORS = ("paged", "contiguous")
POLICIES = Scheduler.POLICIES
PREEMPTION_MODES = SWAP_PREEMPTION_MODES


def poison_from_env() -> bool:
    """``PAGEDBENCH_POISON_KV=1`` in the environment: NaN-fill every LLM's KV pool (tests, debugging)."""
    return os.environ.get("PAGEDBENCH_POISON_KV", "") not in ("", "0")


def positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    return value


def tensor_parallel_size(value: object, model, attention_backend, batch_invariant: bool) -> int:
    from pagedbench.kernels.device import backend
    from pagedbench.refengine.parallel.size import check_tensor_parallel_size

    tp = check_tensor_parallel_size(value, is_gpu=backend().is_gpu)
    if tp > 1 and isinstance(model, LoadedModel):
        raise InvalidArgumentError("tensor_parallel_size > 1 needs what each rank can load itself (a model folder, "
                                   "a ModelConfig, a dict or a YAML path), not a LoadedModel")
    if tp > 1 and not (attention_backend is None or isinstance(attention_backend, str)):
        raise InvalidArgumentError("tensor_parallel_size > 1 needs the attention backend by name, "
                                   f"got {type(attention_backend).__name__}")
    if tp > 1 and batch_invariant:
        raise InvalidArgumentError("batch_invariant=True does not support tensor_parallel_size > 1")
    return tp


#: kv_cache_dtype names -> the cache's torch dtype ("auto": the model's)
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}
#: attention backends that read and write fp8 caches (their launchers quantize and dequantize)
FP8_BACKENDS = ("triton", "torch", "torch-batched")


def swap_space_bytes(preemption_mode: object, swap_space: object, allocator: str, tp: int) -> int:
    """The host pool's bytes for ``preemption_mode`` (0 unless "swap"), or InvalidArgumentError."""
    if not isinstance(preemption_mode, str) or preemption_mode not in PREEMPTION_MODES:
        raise InvalidArgumentError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; "
                                   f"got {preemption_mode!r}")
    if preemption_mode == "swap" and allocator != "paged":
        raise InvalidArgumentError(f"preemption_mode='swap' needs the paged allocator, got allocator={allocator!r}")
    if preemption_mode == "swap" and tp > 1:
        # each rank's pool would need its own host pool and the swaps in the broadcast step
        raise InvalidArgumentError("preemption_mode='swap' is not supported with tensor_parallel_size > 1 yet; "
                                   "use preemption_mode='recompute'")
    return checked_swap_space_bytes(swap_space, available_host_memory_bytes())


def kv_offloading_bytes(kv_offloading_size: object, swap_bytes: int, preemption_mode: str, allocator: str,
                        prefix_caching: object, tp: int) -> int:
    """The prefix cache's host tier in bytes (0: none), or InvalidArgumentError / InsufficientMemoryError;
    with swap preemption its pool and the swap pool must fit the host's available memory together."""
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
    swapping = preemption_mode == "swap"
    return checked_host_space_bytes("kv_offloading_size", kv_offloading_size, available_host_memory_bytes(),
                                    also_bytes=swap_bytes if swapping else 0, also="swap_space")
