"""The ``tensor_parallel_size`` an engine may be given, checked before anything loads or starts."""

from __future__ import annotations

import os

from pagedbench.refengine.errors import InvalidArgumentError


def available_ranks(is_gpu: bool) -> int:
    """How many ranks this machine can hold: its GPUs, or its CPU cores (one rank per core)."""
    if is_gpu:
        import torch

        return torch.cuda.device_count()
    return os.cpu_count() or 1


def check_tensor_parallel_size(value: object, *, is_gpu: bool) -> int:
    """``value`` if it is an int in ``[1, available_ranks(is_gpu)]``; else InvalidArgumentError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"tensor_parallel_size must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"tensor_parallel_size must be >= 1, got {value}")
    limit = available_ranks(is_gpu)
    if value > limit:
        where = f"{limit} GPUs" if is_gpu else f"{limit} CPU cores (os.cpu_count())"
        raise InvalidArgumentError(f"tensor_parallel_size={value} exceeds the machine's {where}")
    return value
