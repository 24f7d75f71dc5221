"""The ranks' communicator: one process group per LLM, with no process-global state.

``torch.distributed``'s default group is one per process, so an engine that made it could not live beside
a second one (tests build many). Each :class:`RankGroup` is a group of its own instead, met through a
``FileStore`` in a private temporary folder: nothing listens on the network for the rendezvous, and
gloo's pairs are bound to 127.0.0.1. On GPUs the same code makes an NCCL group (the backend follows the
device). Every collective waits at most ``timeout_s``; a peer that dies mid-collective ends it at once
with an error (its sockets close), and the group is then unusable.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

#: the host every rank's sockets are bound to: ranks run on one machine, nothing is reachable from outside
LOOPBACK = "127.0.0.1"


def backend_for(device: torch.device) -> str:
    """``"nccl"`` on CUDA devices, ``"gloo"`` on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


class RankGroup:
    """Rank ``rank`` of ``world_size`` ranks meeting through the store file ``store_path``.

    Construction blocks until every rank has constructed its own (at most ``connect_timeout_s``, default
    ``timeout_s``); each collective then waits at most ``timeout_s``."""

    def __init__(self, store_path: str, rank: int, world_size: int, device: torch.device,
                 timeout_s: float, connect_timeout_s: float | None = None) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = backend_for(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(datetime.timedelta(seconds=connect_timeout_s or timeout_s))
        if self.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
            options._timeout = timeout
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, options)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        self._store = store
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM
        self.barrier()  # the group is whole: every rank got here

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over every rank, in place (the same bits on every rank)."""
        self.pg.allreduce([tensor], self._sum).wait()

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))
