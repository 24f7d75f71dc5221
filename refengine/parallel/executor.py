"""Rank 0's executor under tensor parallelism: the model executor, with the model run on every rank.

Rank 0 is the engine's own process: its scheduler plans the step, its persistent block tables turn the
plan into host arrays, and it broadcasts them as a :class:`ShardStep` to ranks 1..N-1 before running its
own shard; the row-parallel layers meet in their all-reduces, so every rank ends the forward with the
same hidden states, and rank 0 alone computes logits and samples. A step is done when every worker has
answered "done": only then does the engine core apply it (the step-transaction rule of ``core.py``).

A rank's failure (a worker that dies, raises, or misses the deadline; rank 0's own forward raising after
the broadcast, which leaves the others in an all-reduce) cannot be undone on the other ranks, so it
closes the group: :class:`TensorParallelError` names the rank, the engine rolls the step back as any
failed step, and every later step fails with the same error.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch
from pagedbench.refengine.engine.model_executor import ModelExecutor
from pagedbench.refengine.engine.scheduler import SchedulerOutput
from pagedbench.refengine.engine.step_inputs import StepInputs
from pagedbench.refengine.model.attention_backend import AttentionMetadata
from pagedbench.refengine.parallel.group import RankGroup
from pagedbench.refengine.parallel.linear import shard_model
from pagedbench.refengine.parallel.shard_step import KVLedger, ShardStep, run_shard_step
from pagedbench.refengine.parallel.worker import RankReport, WorkerSpec
from pagedbench.refengine.parallel.workers import TensorParallelError, WorkerSet


def _seconds_from_env(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    return float(value) if value else default


#: the longest any rank waits for another within a step (a collective, an answer); env override
STEP_TIMEOUT_S = _seconds_from_env("PAGEDBENCH_TP_TIMEOUT_S", 60.0)
#: the longest the start waits for the workers to load their shards and join the group
START_TIMEOUT_S = _seconds_from_env("PAGEDBENCH_TP_START_TIMEOUT_S", 300.0)
#: how long a collective's error waits for the process that caused it to be seen as exited
_EXIT_GRACE_S = 2.0


class TensorParallelExecutor(ModelExecutor):
    """A :class:`ModelExecutor` whose model is rank 0's shard, with ``workers`` holding the others.

    ``ledger``: rank 0's :class:`KVLedger`; :meth:`rank_reports` asks every rank for its own.
    """

    def __init__(self, model, pool, block_manager, block_size: int, *, workers: WorkerSet,
                 group: RankGroup) -> None:
        super().__init__(model, pool, block_manager, block_size)
        self.workers = workers
        self.group = group
        self.tensor_parallel_size = group.world_size
        self.ledger = KVLedger(pool.num_blocks, block_size)

    # --- the step ----------------------------------------------------------------------------------
    def apply_copies(self, out: SchedulerOutput) -> None:
        if out.copies:
            self._run_everywhere(ShardStep(tuple((c.src, c.dst) for c in out.copies), *(None,) * 6))

    def run_model(self, step: StepInputs) -> tuple[torch.Tensor, AttentionMetadata]:
        shard = ShardStep((), step.input_ids, step.positions, step.slot_mapping, step.block_tables,
                          step.seq_lens, step.query_lens)
        return self._run_everywhere(shard)

    def _run_everywhere(self, shard: ShardStep):
        workers = self.workers
        if workers.failure is not None:
            raise TensorParallelError(f"the tensor-parallel group is closed: {workers.failure}")
        dead = workers.culprit("before the step")
        if dead is not None:
            raise workers.fail(dead)
        try:
            workers.send_all("step", shard, "before the step")
            try:
                result = run_shard_step(self.model, self.pool, self.kv_caches, shard, self.ledger)
            except BaseException as exc:
                raise workers.fail(self._who_failed(exc)) from exc
            workers.wait_all("done", workers.timeout_s, "during the step")
        except TensorParallelError as error:
            cause = error.__cause__
            if cause is not None and not isinstance(cause, Exception):
                raise cause from None  # Ctrl-C, SystemExit: the group is closed, and they propagate as themselves
            raise
        except BaseException:
            # interrupted between the broadcast and the last answer: the ranks are out of step for good
            workers.fail("a step was interrupted on rank 0 after its broadcast")
            raise
        return result

    def _who_failed(self, exc: BaseException) -> str:
        """Name the rank behind ``exc``, raised by rank 0's shard: a worker that stopped (its sockets closed,
        so rank 0's all-reduce failed), the workers that never answered (the all-reduce timed out), else
        rank 0 itself."""
        timed_out = isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()
        deadline = time.monotonic() + _EXIT_GRACE_S
        while True:
            dead = self.workers.culprit("during the step")
            if dead is not None or timed_out or time.monotonic() > deadline or not isinstance(exc, RuntimeError):
                break
            time.sleep(0.05)
        if dead is not None:
            return dead
        if timed_out:
            silent = ", ".join(f"rank {i + 1} (pid {pid})" for i, pid in enumerate(self.workers.pids))
            return (f"tensor-parallel rank 0 waited {self.workers.timeout_s:g} s in an all-reduce during the step "
                    f"for ranks that did not join it (running but not answering: {silent})")
        return (f"tensor-parallel rank 0 (pid {os.getpid()}) failed during the step "
                f"({type(exc).__name__}: {exc}); the other ranks could not finish it")

    # --- accounting --------------------------------------------------------------------------------
    def rank_reports(self) -> list[RankReport]:
        """Every rank's account of its KV pool, rank 0 first."""
        pool, ledger = self.pool, self.ledger
        own = RankReport(0, os.getpid(), pool.num_blocks, pool.block_size, pool.num_kv_heads, ledger.num_steps,
                         ledger.slot_token.copy())
        if self.workers.failure is not None:
            raise TensorParallelError(f"the tensor-parallel group is closed: {self.workers.failure}")
        self.workers.send_all("report", None, "asked for its report")
        return [own, *self.workers.wait_all("report", self.workers.timeout_s, "asked for its report")]

    def rank_mismatches(self, sequences) -> list[str]:
        """Where a rank's KV accounting differs from rank 0's, or rank 0's from its block manager for
        ``sequences`` (the running ones, say): one line each; empty when every rank agrees."""
        reports = self.rank_reports()
        bad = [f"rank 0: {line}" for line in self.ledger.mismatches(self.block_manager, sequences)]
        first = reports[0]
        if first.num_blocks != self.block_manager.num_blocks:
            bad.append(f"rank 0: {first.num_blocks} blocks, its block manager {self.block_manager.num_blocks}")
        for r in reports[1:]:
            for field in ("num_blocks", "block_size", "num_kv_heads", "num_steps"):
                if getattr(r, field) != getattr(first, field):
                    bad.append(f"rank {r.rank}: {field} {getattr(r, field)} != rank 0's {getattr(first, field)}")
            differ = (r.slot_token != first.slot_token).nonzero()[0]
            if differ.size:
                s = int(differ[0])
                bad.append(f"rank {r.rank}: {differ.size} slots differ from rank 0's, first slot {s}: "
                           f"token {int(r.slot_token[s])} != {int(first.slot_token[s])}")
        return bad

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self.workers.close()


def start_tensor_parallel(source, model, pool, block_manager, block_size: int, world_size: int, *,
                          seed: int) -> TensorParallelExecutor:
    """Spawn ranks 1..``world_size``-1 (each loading ``source`` as rank 0 did, then cutting its shard and
    making a pool of ``pool.num_blocks`` blocks), cut ``model`` down to rank 0's shard, and return rank 0's
    executor once the group is whole. Raises TensorParallelError naming a rank that failed to start (no
    worker is left running)."""
    backend = getattr(model.attention_backend, "name", None)
    store_dir = tempfile.mkdtemp(prefix="pagedbench-tp-")
    device = model.device
    indices = None
    if device.type == "cuda":
        count, first = torch.cuda.device_count(), device.index or 0
        indices = [(first + r) % count for r in range(world_size)]
    spec = WorkerSpec(0, world_size, source, model.dtype, backend, seed, pool.num_blocks, block_size, pool.dtype,
                      pool.poison, os.path.join(store_dir, "store"), STEP_TIMEOUT_S, START_TIMEOUT_S, os.getpid(),
                      None)
    workers = WorkerSet(spec, store_dir, indices)
    try:
        group: list[RankGroup] = []
        shard_model(model, 0, world_size, lambda t: group[0].all_reduce(t))
        workers.wait_all("loaded", START_TIMEOUT_S, "at start")
        group.append(RankGroup(spec.store_path, 0, world_size, device, STEP_TIMEOUT_S, START_TIMEOUT_S))
        workers.wait_all("ready", START_TIMEOUT_S, "at start")
    except BaseException:
        workers.close()
        raise
    shutil.rmtree(store_dir, ignore_errors=True)  # the group is whole: nobody reads the store again
    return TensorParallelExecutor(model, pool, block_manager, block_size, workers=workers, group=group[0])
