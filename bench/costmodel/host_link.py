"""Copies between a GPU's KV blocks and host memory, priced over the GPU's host link (PCIe).

Swap preemption moves a victim's blocks to a host pool and back; a host KV tier loads cached blocks
back the same way. Each GPU profile (``bench/configs/hardware/<name>.yaml``) names its link and gives
one direction's achievable bandwidth ``B`` and the fixed cost ``L`` of one transfer. A copy of ``n``
bytes in ``k`` transfers takes::

    k * L + n / B                                   (HostLink.transfer_s)

A block holds ``block_size`` tokens' K and V in every layer; under tensor parallelism over ``N`` GPUs each
GPU holds ``ceil(kv_heads / N)`` heads of it (a KV head is never split: the rule of
:mod:`pagedbench.bench.costmodel.kv_slots`) and copies its share over its own link at the same time as
the others, so a block's copy takes one GPU's share::

    bytes_per_block = block_size * 2 * layers * ceil(kv_heads / N) * head_dim * dtype_bytes
    block_s         = transfers_per_block * L + bytes_per_block / B

The transfer granularity is the engine's layout choice. ``"per_block"`` (vLLM v0's ``swap_blocks``, the
paper's system: one ``cudaMemcpyAsync`` per block per layer, for K and for V) makes ``2 * layers``
transfers a block, which is why small blocks swap slowly (the paper's Fig. 19); ``"per_layer"`` (our
engine's :func:`~pagedbench.refengine.kv.swap_copy.copy_blocks_between`: one gathered copy per layer
for K and for V, whatever the number of blocks) makes ``2 * layers`` transfers a *step*, priced here
as ``2 * layers / num_blocks`` a block by :meth:`BlockCopyCost.step_s`. Swap-outs and swap-ins of one
step run one after the other (one copy stream), so their times add.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedbench.bench.costmodel.hardware import HardwareProfile
from pagedbench.bench.costmodel.kv_slots import check_tensor_parallel_size, kv_heads_per_gpu
from pagedbench.bench.costmodel.models import ModelProfile

LAYOUTS = ("per_block", "per_layer")


@dataclass(frozen=True, slots=True)
class HostLink:
    """A GPU's link to host memory: one direction's achievable bandwidth and one transfer's fixed cost."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def transfer_s(self, num_bytes: int, num_transfers: int = 1) -> float:
        """Seconds to move ``num_bytes`` in ``num_transfers`` copies (module docstring)."""
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(f"num_bytes must be an int >= 0, got {num_bytes!r}")
        if isinstance(num_transfers, bool) or not isinstance(num_transfers, int) or num_transfers < 0:
            raise ValueError(f"num_transfers must be an int >= 0, got {num_transfers!r}")
        return num_transfers * self.latency_s + num_bytes / self.bandwidth_bytes_per_s


def host_link(hardware: HardwareProfile) -> HostLink:
    """The host link ``hardware``'s profile names."""
    return HostLink(hardware.host_link, hardware.host_link_bandwidth_bytes_per_s, hardware.host_link_latency_s)


def kv_bytes_per_block(model: ModelProfile, block_size: int, tensor_parallel_size: int = 1,
                       kv_cache_dtype: str = "auto") -> int:
    """One GPU's bytes of one block: ``block_size`` tokens' K and V in every layer, its share of the KV heads."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    tp = check_tensor_parallel_size(model, tensor_parallel_size)
    per_token = model.kv_bytes_per_token_as(kv_cache_dtype) // model.num_key_value_heads * kv_heads_per_gpu(model, tp)
    return block_size * per_token


@dataclass(frozen=True, slots=True)
class BlockCopyCost:
    """The price of copying KV blocks over ``link``: :meth:`__call__` is what the serving simulator asks
    for (``step_time_s.block_copy_s(num_swapped_out, num_swapped_in)``, seconds added to the step)."""

    link: HostLink
    block_size: int
    bytes_per_block: int  # one GPU's share (tensor parallel: its KV heads)
    num_layers: int
    layout: str = "per_block"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @classmethod
    def of(cls, model: ModelProfile, hardware: HardwareProfile, block_size: int, *, tensor_parallel_size: int = 1,
           kv_cache_dtype: str = "auto", layout: str = "per_block") -> BlockCopyCost:
        return cls(host_link(hardware), block_size,
                   kv_bytes_per_block(model, block_size, tensor_parallel_size, kv_cache_dtype),
                   model.num_hidden_layers, layout)

    @property
    def transfers_per_block(self) -> int:
        """Copies one block takes in the ``per_block`` layout: one per layer for K and one for V."""
        return 2 * self.num_layers

    @property
    def block_s(self) -> float:
        """One block's copy alone, one direction (in either layout a lone block takes ``2 * layers`` transfers)."""
        return self.link.transfer_s(self.bytes_per_block, self.transfers_per_block)

    def step_s(self, num_blocks: int) -> float:
        """``num_blocks`` blocks copied one way in one step."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if num_blocks == 0:
            return 0.0
        transfers = num_blocks * self.transfers_per_block if self.layout == "per_block" else self.transfers_per_block
        return self.link.transfer_s(num_blocks * self.bytes_per_block, transfers)

    def load_s(self, num_blocks: int) -> float:
        """A host tier's load of ``num_blocks`` cached blocks (host to device: a swap-in's copy)."""
        return self.step_s(num_blocks)

    def __call__(self, num_swapped_out: int, num_swapped_in: int) -> float:
        return self.step_s(num_swapped_out) + self.step_s(num_swapped_in)


def per_block_s(cost: BlockCopyCost, num_blocks: int) -> float:
    """Seconds per block when ``num_blocks`` are copied together (the per-layer layout spreads its fixed cost)."""
    return cost.step_s(num_blocks) / num_blocks if num_blocks else math.nan
