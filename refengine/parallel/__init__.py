"""Tensor parallelism: one scheduler on rank 0, every rank a slice of each layer and of the KV heads.

- ``linear``: column- and row-parallel linear layers, and the cut of a model into shards;
- ``group``: the ranks' communicator (gloo on 127.0.0.1, NCCL on GPUs), one per engine;
- ``shard_step``: what every rank runs in a step (:class:`ShardStep`) and its KV ledger;
- ``worker`` / ``workers``: ranks 1..N-1 as spawned processes, and rank 0's handle on them;
- ``executor``: rank 0's executor, which broadcasts each step and runs its own shard.

``LLM(..., tensor_parallel_size=N)`` builds all of it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TensorParallelError": "pagedbench.refengine.parallel.workers",
    "TensorParallelExecutor": "pagedbench.refengine.parallel.executor",
    "ShardStep": "pagedbench.refengine.parallel.shard_step",
    "RankReport": "pagedbench.refengine.parallel.worker",
    "check_tensor_parallel_size": "pagedbench.refengine.parallel.size",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
