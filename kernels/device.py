"""The one place that decides where PagedBench runs.

The decision is made once, at first import, before any Triton kernel is defined (Triton reads
``TRITON_INTERPRET`` when ``@triton.jit`` runs):

* a CUDA GPU is present  -> backend ``"gpu"``: KV memory in CuPy, Triton kernels compiled;
* no GPU                 -> backend ``"cpu"``: KV memory in NumPy, Triton kernels under the interpreter
                            (``TRITON_INTERPRET=1``).

``PAGEDBENCH_DEVICE=cpu|gpu|auto`` overrides the detection (``gpu`` without a GPU is an error). The chosen
backend is reported in every result record through :func:`describe`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch

ENV_VAR = "PAGEDBENCH_DEVICE"


@dataclass(frozen=True, slots=True)
class Backend:
    name: str  # "gpu" or "cpu"
    torch_device: torch.device  # where tensors live: cuda:0 or cpu
    triton_interpret: bool  # True when Triton kernels run under the interpreter
    reason: str  # why this backend was chosen, for result records

    @property
    def is_gpu(self) -> bool:
        return self.name == "gpu"


@cache
def backend() -> Backend:
    """The backend for this process (decided once; see the module docstring)."""
    requested = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if requested not in ("auto", "cpu", "gpu"):
        raise ValueError(f"{ENV_VAR} must be one of auto, cpu, gpu; got {requested!r}")
    has_gpu = torch.cuda.is_available()
    if requested == "gpu" and not has_gpu:
        raise RuntimeError(f"{ENV_VAR}=gpu but torch sees no CUDA device")
    if requested == "cpu" or (requested == "auto" and not has_gpu):
        os.environ["TRITON_INTERPRET"] = "1"
        why = f"{ENV_VAR}=cpu" if requested == "cpu" else "no CUDA device found"
        return Backend("cpu", torch.device("cpu"), True, why)
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    why = f"{ENV_VAR}=gpu" if requested == "gpu" else "CUDA device found"
    return Backend("gpu", torch.device("cuda", torch.cuda.current_device()), interpret, why)


def describe() -> dict[str, object]:
    """The backend as a plain record, for result files."""
    b = backend()
    record: dict[str, object] = {
        "backend": b.name,
        "torch_device": str(b.torch_device),
        "triton_interpret": b.triton_interpret,
        "reason": b.reason,
    }
    if b.is_gpu:
        props = torch.cuda.get_device_properties(b.torch_device)
        record["gpu_name"] = props.name
        record["gpu_memory_bytes"] = props.total_memory
        record["cuda_version"] = torch.version.cuda
    return record


backend()  # decide now, before any kernel module is imported
