"""The checks of :class:`~pagedbench.refengine.engine.llm.LLM`'s arguments that need more than a line,
and the names of the values they take: every argument is checked before the model loads or a pool is
allocated, so a bad one costs nothing and changes nothing. The host-memory arguments' checks are
torch-free, for the command line: ``engine/host_memory_arguments.py``."""

from __future__ import annotations

import os

import torch
from pagedbench.refengine.engine.scheduler import Scheduler
from pagedbench.refengine.engine.swap_preemption import PREEMPTION_MODES as SWAP_PREEMPTION_MODES
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.model.loader import LoadedModel
from pagedbench.refengine.model.prepacked_linear import check_linear_path

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


def check_options(*, allocator: str, policy: str, watermark_blocks: object, kv_cache_dtype: str,
                  batch_invariant: bool, linear_path: str, tensor_parallel_size: int) -> None:
    """The allocator, scheduling, cache-dtype and linear-path arguments, alone and together."""
    if allocator not in ALLOCATORS:
        raise InvalidArgumentError(f"allocator must be one of {', '.join(ALLOCATORS)}; got {allocator!r}")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise InvalidArgumentError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if isinstance(watermark_blocks, bool) or not isinstance(watermark_blocks, int) or watermark_blocks < 0:
        raise InvalidArgumentError(f"watermark_blocks must be an int >= 0, got {watermark_blocks!r}")
    if watermark_blocks and allocator != "paged":
        raise InvalidArgumentError(f"watermark_blocks applies to the paged allocator only, got "
                                   f"watermark_blocks={watermark_blocks} with allocator={allocator!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InvalidArgumentError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                                   f"got {kv_cache_dtype!r}")
    if batch_invariant and kv_cache_dtype != "auto":
        # the batch-invariant attention reads the cache in the model's dtype: it has no fp8 dequantize
        raise InvalidArgumentError(f"batch_invariant=True does not support kv_cache_dtype={kv_cache_dtype!r}; "
                                   "use kv_cache_dtype='auto'")
    if check_linear_path(linear_path) == "onednn" and tensor_parallel_size > 1:
        raise InvalidArgumentError("linear_path='onednn' applies to tensor_parallel_size=1 only; the ranks run "
                                   "F.linear")
