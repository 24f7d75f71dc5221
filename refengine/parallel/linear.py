"""Megatron-style tensor-parallel linear layers, and the cut of a Llama model into ``world_size`` shards.

A column-parallel layer holds a slice of the output features and needs no communication; a row-parallel
layer holds the matching slice of the input features and sums its partial products over the ranks (one
all-reduce). In a decoder layer the two pair up so that each block costs one all-reduce::

    x [T, hidden] (whole, identical on every rank)
      |-- q/k/v_proj   column: heads [r*H/N, (r+1)*H/N)   -> attention over this rank's KV heads
      |-- o_proj       row:    partial [T, hidden]        -> all-reduce -> + bias -> whole
      |-- gate/up_proj column: features [r*I/N, (r+1)*I/N)
      `-- down_proj    row:    partial [T, hidden]        -> all-reduce -> whole

Each part is sharded alone and the rank's shards are then fused (``model.fused_linear``): cutting the
fused q/k/v weight as one block would hand a rank some of q's heads and none of v's.

Query head ``h`` of a rank reads KV head ``h // (H / Hkv)`` of the same rank: the contiguous slices keep
each GQA group on one rank, since ``H / N = (Hkv / N) * (H / Hkv)``. Embeddings, norms and the LM head are
replicated (every rank holds them whole).

A row-parallel layer's bias is added once, after the sum; adding it on every rank would count it N times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pagedbench.refengine.errors import InvalidArgumentError
from torch import nn
from torch.nn import functional as F

#: an in-place sum of a tensor over every rank of the group
AllReduce = Callable[[torch.Tensor], None]


def _slice(total: int, rank: int, world_size: int, what: str) -> slice:
    if total % world_size:
        raise InvalidArgumentError(f"{what} ({total}) is not divisible by tensor_parallel_size={world_size}")
    part = total // world_size
    return slice(rank * part, (rank + 1) * part)


class ColumnParallelLinear(nn.Module):
    """Rank ``rank``'s output features ``[rank * out/N, (rank+1) * out/N)`` of ``full`` (its bias too).
    x [T, in] -> [T, out/N]."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int, *, features_per_unit: int = 1,
                 what: str = "out_features") -> None:
        super().__init__()
        units = full.out_features // features_per_unit  # whole heads, not features, are split
        part = _slice(units, rank, world_size, what)
        rows = slice(part.start * features_per_unit, part.stop * features_per_unit)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone(),
                                                                requires_grad=False)
        self.in_features, self.out_features = full.in_features, rows.stop - rows.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank ``rank``'s input features of ``full``; the partial products are summed by ``all_reduce``.
    x [T, in/N] -> [T, out], identical on every rank."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int, all_reduce: AllReduce, *,
                 features_per_unit: int = 1, what: str = "in_features") -> None:
        super().__init__()
        units = full.in_features // features_per_unit
        part = _slice(units, rank, world_size, what)
        cols = slice(part.start * features_per_unit, part.stop * features_per_unit)
        self.weight = nn.Parameter(full.weight.detach()[:, cols].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = cols.stop - cols.start, full.out_features
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        self.all_reduce(out)
        return out if self.bias is None else out + self.bias


def check_shardable(config, world_size: int) -> None:
    """Raise InvalidArgumentError unless ``config``'s heads, KV heads and MLP width split into
    ``world_size`` equal parts."""
    for what, total in (("num_attention_heads", config.num_attention_heads),
                        ("num_key_value_heads", config.num_key_value_heads),
                        ("intermediate_size", config.intermediate_size)):
        if total % world_size:
            raise InvalidArgumentError(
                f"tensor_parallel_size={world_size} must divide the model's {what} ({total})")


def shard_model(model, rank: int, world_size: int, all_reduce: AllReduce) -> None:
    """Cut ``model`` (a :class:`~pagedbench.refengine.model.llama.LlamaModel`) in place down to rank
    ``rank``'s shard: its attention layers then attend over ``num_key_value_heads / world_size`` KV heads
    (the KV caches the forward is given must have that many)."""
    config = model.config
    check_shardable(config, world_size)
    d = config.head_dim
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj = ColumnParallelLinear(attn.q_proj, rank, world_size, features_per_unit=d,
                                           what="num_attention_heads")
        attn.k_proj = ColumnParallelLinear(attn.k_proj, rank, world_size, features_per_unit=d,
                                           what="num_key_value_heads")
        attn.v_proj = ColumnParallelLinear(attn.v_proj, rank, world_size, features_per_unit=d,
                                           what="num_key_value_heads")
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world_size, all_reduce, features_per_unit=d,
                                        what="num_attention_heads")
        attn.num_heads //= world_size
        attn.num_kv_heads //= world_size
        mlp = layer.mlp
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, rank, world_size, what="intermediate_size")
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, rank, world_size, what="intermediate_size")
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world_size, all_reduce, what="intermediate_size")
    # each part was cut on its own (q, k, v by heads; gate, up by features): fuse this rank's shards
    model.fuse_projections()
