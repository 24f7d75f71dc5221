"""Rank 0's side of the workers: spawn them, wait for them (always with a deadline), send each one the
same message, collect their answers, name the rank that failed, and stop them all.

The processes are spawned (``torch.multiprocessing``, "spawn": a fresh interpreter, never a fork of an
engine with threads and a loaded model) and daemonic, and :class:`WorkerSet` stops them through a
``weakref.finalize`` that also runs at interpreter exit: no path leaves a worker behind (a worker whose
parent dies anyway exits by itself, see ``worker.py``).
"""

from __future__ import annotations

import contextlib
import pickle
import shutil
import signal
import time
import weakref
from dataclasses import replace

import torch.multiprocessing as mp
from pagedbench.refengine.parallel.worker import WorkerSpec, worker_main

#: seconds stopped workers get to exit before they are killed (after a failure, when they may be stuck in a
#: collective that will never end, less)
_JOIN_S = 5.0
_JOIN_AFTER_FAILURE_S = 1.0


class TensorParallelError(RuntimeError):
    """A rank failed (died, raised, or missed a deadline); the message names it. The tensor-parallel
    group is closed afterwards: every later step fails with this error too."""


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "is alive"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _stop(procs: list, conns: list, store_dir: str | None, join_s: float = _JOIN_S) -> None:
    """Stop every worker: ask, then kill those still running after ``join_s`` (in all)."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):  # (a dead worker's pipe)
            conn.send(("stop", None))
    deadline = time.monotonic() + join_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():  # stuck (in a collective, or stopped): it holds nothing to clean up
            proc.kill()
            proc.join(_JOIN_S)
    for conn in conns:
        conn.close()
    if store_dir is not None:
        shutil.rmtree(store_dir, ignore_errors=True)


class WorkerSet:
    """Ranks 1..N-1 built from ``spec`` (its ``rank`` replaced per worker), started at construction.

    ``pids``: the workers' process ids, by rank (rank 1 first). Every wait here ends after
    ``spec.timeout_s`` (``start_timeout_s`` for the start) with a :class:`TensorParallelError`.
    """

    def __init__(self, spec: WorkerSpec, store_dir: str, device_indices: list[int] | None) -> None:
        ctx = mp.get_context("spawn")
        self.timeout_s = spec.timeout_s
        self.procs, self.conns = [], []
        self.failure: str | None = None  # why the group is closed (None: open)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, store_dir)
        try:
            for rank in range(1, spec.world_size):
                ours, theirs = ctx.Pipe(duplex=True)
                self.conns.append(ours)
                device = None if device_indices is None else device_indices[rank]
                proc = ctx.Process(target=worker_main, args=(replace(spec, rank=rank, device_index=device), theirs),
                                   name=f"pagedbench-tp-rank{rank}", daemon=True)
                proc.start()
                theirs.close()
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_all(self, kind: str, timeout_s: float, what: str) -> list:
        """Each worker's next message, which must be ``kind``; returns their bodies by rank."""
        bodies = []
        deadline = time.monotonic() + timeout_s
        for i, conn in enumerate(self.conns):
            bodies.append(self._receive(i, conn, kind, deadline, timeout_s, what))
        return bodies

    def _receive(self, i: int, conn, kind: str, deadline: float, timeout_s: float, what: str):
        rank, proc = i + 1, self.procs[i]
        while True:
            left = deadline - time.monotonic()
            try:
                ready = conn.poll(max(0.0, min(left, 0.5)))
                if ready:
                    got, body = conn.recv()
                    if got == kind:
                        return body
                    if got == "error":
                        raise self.fail(f"tensor-parallel rank {rank} (pid {proc.pid}) failed {what}:\n{body}")
                    raise self.fail(f"tensor-parallel rank {rank} answered {got!r} {what}, expected {kind!r}")
            except (EOFError, OSError):
                ready = False
            if not ready and not proc.is_alive():
                raise self.fail(f"tensor-parallel rank {rank} (pid {proc.pid}) {_exit_reason(proc.exitcode)} {what}")
            if not ready and left <= 0:
                raise self.fail(f"tensor-parallel rank {rank} (pid {proc.pid}) did not answer within "
                                f"{timeout_s:g} s {what}")

    def send_all(self, kind: str, body, what: str) -> None:
        """The same message to every worker (pickled once)."""
        payload = pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL)
        for i, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except (OSError, ValueError):
                raise self.fail(self.culprit(what) or f"tensor-parallel rank {i + 1}: its pipe is closed") from None

    def culprit(self, what: str) -> str | None:
        """A line naming the first worker that is no longer running, with the error it reported if it
        did (None: every one is running)."""
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                line = f"tensor-parallel rank {i + 1} (pid {proc.pid}) {_exit_reason(proc.exitcode)} {what}"
                words = self._last_words(self.conns[i])
                return line if words is None else f"{line}: {words}"
        return None

    @staticmethod
    def _last_words(conn) -> str | None:
        """The last line of the traceback a dead worker sent before exiting, if it sent one."""
        try:
            while conn.poll(0):
                kind, body = conn.recv()
                if kind == "error":
                    return body.strip().splitlines()[-1]
        except (EOFError, OSError, ValueError):
            pass
        return None

    def fail(self, why: str) -> TensorParallelError:
        """Close the group (stop every worker) and return the error to raise; the first reason sticks."""
        if self.failure is None:
            self.failure = why
        self.close(join_s=_JOIN_AFTER_FAILURE_S)
        return TensorParallelError(why)

    def close(self, join_s: float = _JOIN_S) -> None:
        """Stop every worker (idempotent); every later step fails with a TensorParallelError."""
        if self.failure is None:
            self.failure = "its workers were stopped (LLM.close)"
        stop = self._finalizer.detach()  # (None once stopped)
        if stop is not None:
            _, func, args, _ = stop
            func(*args, join_s=join_s)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
