"""A tensor-parallel worker: ranks 1..N-1, each a spawned process holding one shard and its own KV pool.

The worker decides nothing. It builds its shard and pool, joins the group, then serves rank 0's messages
on its pipe, one at a time:

    rank 0 -> worker                          worker -> rank 0
    ("step", ShardStep)   run it          ->  ("done", None)
    ("report", None)      its pool state  ->  ("report", RankReport)
    ("stop", None)        exit 0
                          (at start)          ("loaded", None), then ("ready", None) once the group is whole
                          (any failure)       ("error", traceback text), then exit 1

A failure ends the process: its sockets close, so rank 0 and every other rank leave the step's pending
all-reduce at once with an error instead of waiting for it. A worker whose parent is gone exits too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: seconds between two looks at whether the parent still lives, while no message comes
_IDLE_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to build rank ``rank``'s shard and pool like rank 0's."""

    rank: int
    world_size: int
    source: Any  # what load_model takes: a model folder, a ModelConfig, a dict or a YAML path
    dtype: torch.dtype
    attention_backend: str | None
    seed: int
    num_blocks: int  # rank 0's: every pool has the same block ids
    block_size: int
    kv_dtype: torch.dtype
    poison: bool
    store_path: str
    timeout_s: float  # the longest a collective or an answer within a step may take
    start_timeout_s: float  # the longest the start may wait for the other ranks
    parent_pid: int
    device_index: int | None  # the CUDA device of this rank; None on the CPU


@dataclass(frozen=True, slots=True)
class RankReport:
    """A rank's account of its KV pool (see :class:`~pagedbench.refengine.parallel.shard_step.KVLedger`)."""

    rank: int
    pid: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # this rank's share
    num_steps: int  # shard steps applied
    slot_token: np.ndarray  # int64 [num_blocks * block_size]


def build_shard(spec: WorkerSpec, all_reduce):
    """``(model, pool)`` of rank ``spec.rank``: the model loaded whole as rank 0 loaded it, then cut."""
    from pagedbench.refengine.kv.block_pool import BlockPool
    from pagedbench.refengine.model.loader import load_model
    from pagedbench.refengine.parallel.linear import shard_model

    model = load_model(spec.source, dtype=spec.dtype, attention_backend=spec.attention_backend,
                       seed=spec.seed).model
    shard_model(model, spec.rank, spec.world_size, all_reduce)
    cfg = model.config
    pool = BlockPool(cfg.num_hidden_layers, cfg.num_key_value_heads // spec.world_size, cfg.head_dim,
                     spec.block_size, spec.kv_dtype, num_blocks=spec.num_blocks, poison=spec.poison)
    return model, pool


def worker_main(spec: WorkerSpec, conn) -> None:
    """The spawned process's entry: build, join, serve; exit 1 after reporting any failure."""
    try:
        if spec.device_index is not None:
            torch.cuda.set_device(spec.device_index)
        from pagedbench.refengine.parallel.group import RankGroup

        group: list[RankGroup] = []  # bound once the group exists; the shard's layers call through it
        model, pool = build_shard(spec, lambda t: group[0].all_reduce(t))
        conn.send(("loaded", None))
        group.append(RankGroup(spec.store_path, spec.rank, spec.world_size, model.device, spec.timeout_s,
                               spec.start_timeout_s))
        conn.send(("ready", None))
        _serve(spec, conn, model, pool)
    except BaseException:
        with contextlib.suppress(OSError, ValueError):  # (rank 0 gone: nobody to tell)
            conn.send(("error", traceback.format_exc()))
        sys.exit(1)


def _serve(spec: WorkerSpec, conn, model, pool) -> None:
    from pagedbench.refengine.parallel.shard_step import KVLedger, run_shard_step

    ledger = KVLedger(pool.num_blocks, pool.block_size)
    kv_caches = pool.kv_caches()
    while True:
        if not conn.poll(_IDLE_POLL_S):
            if os.getppid() != spec.parent_pid:
                return  # orphaned: the engine died without stopping us
            continue
        try:
            kind, body = conn.recv()
        except EOFError:
            return  # rank 0 closed the pipe
        if kind == "stop":
            return
        if kind == "step":
            run_shard_step(model, pool, kv_caches, body, ledger)  # (its hidden states are rank 0's to use)
            conn.send(("done", None))
        elif kind == "report":
            conn.send(("report", RankReport(spec.rank, os.getpid(), pool.num_blocks, pool.block_size,
                                            pool.num_kv_heads, ledger.num_steps, ledger.slot_token.copy())))
        else:
            raise RuntimeError(f"worker rank {spec.rank}: unknown message {kind!r}")
