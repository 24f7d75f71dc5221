"""Several linear layers over the same input as one matrix multiply (q/k/v; gate/up), their weights kept
in one tensor that the layers' own parameters are views of.

On a CPU a matmul's cost has a large fixed part per call: one ``[T, in] @ [in, q + k + v]`` is faster than
three calls of a third of the width each (vLLM fuses the same projections, ``QKVParallelLinear`` and
``MergedColumnParallelLinear``). The parts stay the model's parameters, under their checkpoint names::

    fused.weight  [out_0 + out_1 + ..., in]   one allocation
      rows [0, out_0)            = layers[0].weight (a view)
      rows [out_0, out_0 + out_1) = layers[1].weight (a view)   ...

so the state dict, a checkpoint load, ``init_random_weights`` or any in-place write to a part reach the
fused tensor, and the weights take no extra memory. A part that stops being a view of it (replaced by a
new tensor: ``model.to(dtype)``, tensor-parallel sharding, an assignment) makes :meth:`FusedLinear.current`
false; :func:`fused` then concatenates the parts again. Each part of a tensor-parallel model is sharded on
its own (q, k and v by heads, gate and up by features) and the shards fused after, never one block.

A fused call may round differently in the last bits from separate calls (a BLAS blocks its work by the
output width too); the engine's tests hold it to the same tolerances and greedy tokens as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class FusedLinear:
    """The concatenated weight (and bias) of ``len(split_sizes)`` layers; ``split_sizes`` their widths."""

    weight: torch.Tensor  # [sum(split_sizes), in_features]; the parts' weights are views of its rows
    bias: torch.Tensor | None  # [sum(split_sizes)] (the parts' biases are views), None if they have none
    split_sizes: tuple[int, ...]  # out_features of each part, in order
    part_ptrs: tuple[int, ...]  # data_ptr() each part's weight must have for this fusion to be current

    def current(self, layers: Sequence[nn.Module]) -> bool:
        """Whether every part's weight is still its view of :attr:`weight` (same device and dtype)."""
        return len(layers) == len(self.part_ptrs) and all(
            layer.weight.data_ptr() == ptr and layer.weight.dtype == self.weight.dtype
            and layer.weight.device == self.weight.device
            for layer, ptr in zip(layers, self.part_ptrs))


def fuse(layers: Sequence[nn.Module]) -> FusedLinear | None:
    """Concatenate ``layers``' weights (and biases) and re-point each layer's at its rows of the result.

    Returns None (the layers are left as they are) when they cannot share one matmul: different input
    widths, dtypes or devices, or biases on some only."""
    weights = [layer.weight for layer in layers]
    biases = [getattr(layer, "bias", None) for layer in layers]
    if (len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1 or any(w.dim() != 2 for w in weights)
            or len({b is None for b in biases}) != 1):
        return None
    # outside inference mode: the parameters made here may be written in place later (a checkpoint load)
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([w.detach() for w in weights])
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        start, ptrs = 0, []
        for layer, w in zip(layers, weights):
            rows = slice(start, start + w.shape[0])
            layer.weight = nn.Parameter(weight[rows], requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias[rows], requires_grad=False)
            ptrs.append(layer.weight.data_ptr())
            start = rows.stop
    return FusedLinear(weight, bias, tuple(w.shape[0] for w in weights), tuple(ptrs))


def fused(current: FusedLinear | None, layers: Sequence[nn.Module]) -> FusedLinear | None:
    """``current`` if it is still the layers' fusion, else a new :func:`fuse` of them."""
    if current is not None and current.current(layers):
        return current
    return fuse(layers)
