"""How many threads torch gives the engine's CPU work.

torch starts with one OpenMP thread per CPU it counts, which may be more than the CPUs this process may
run on (a container's or ``taskset``'s affinity mask) or count SMT siblings as cores. More threads than
cores only wait on each other at every operator's barrier: the engine runs dozens of small operators per
layer, so the waits add up (vLLM's CPU worker likewise sizes its OpenMP pool to the cores it is given).

The rule, applied once when an ``LLM`` is built on the CPU:

* ``num_threads=N`` given: torch runs N threads (an explicit setting wins);
* otherwise, when the environment sets ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS``: left as it is;
* otherwise: lowered to the physical cores among the CPUs this process may use, never raised (a
  program that lowered torch's count itself keeps it).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from pagedbench.refengine.errors import InvalidArgumentError

#: variables by which a user sets OpenMP's or MKL's thread count for the whole process
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask; every CPU where the OS has no such call)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int], topology: Path = Path("/sys/devices/system/cpu")) -> int:
    """How many distinct physical cores ``cpus`` span (SMT siblings count once); ``len(cpus)`` where the
    topology files cannot be read."""
    cores = set()
    for cpu in cpus:
        base = topology / f"cpu{cpu}" / "topology"
        try:
            cores.add((base.joinpath("physical_package_id").read_text().strip(),
                       base.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def configure_threads(num_threads: int | None) -> int:
    """Apply the module's rule to torch's intra-op thread count; returns the count torch then has."""
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise InvalidArgumentError(f"num_threads must be an int >= 1 or None, got {num_threads!r}")
        torch.set_num_threads(num_threads)
    elif not any(os.environ.get(name) for name in THREAD_ENV_VARS):
        cores = physical_cores(usable_cpus())
        if torch.get_num_threads() > cores:
            torch.set_num_threads(cores)
    return torch.get_num_threads()


def engine_threads(num_threads: int | None) -> int | None:
    """torch's thread count after :func:`configure_threads` on a CPU host; None (untouched) on a GPU."""
    from pagedbench.kernels import device

    if device.backend().is_gpu:
        if num_threads is not None:  # still checked, and still applied: it was asked for
            return configure_threads(num_threads)
        return None
    return configure_threads(num_threads)
