"""SGLang's Triton ``merge_state_triton`` (``sglang/kernels/ops/attention/merge_state.py``) behind the adapter.

It merges two partial attentions through their natural-log LSEs (SGLang's cascade and chunked-prefix
paths), in our layouts: outputs ``[num_tokens, num_heads, head_dim]``, LSEs ``[num_tokens, num_heads]``.
The kernel indexes both as contiguous (it takes no strides), so the adapter hands it contiguous tensors
and copies into a caller's non-contiguous ``out=``; the inputs the gate passes are contiguous anyway.
Declared: ``merge_attn_states`` only, every dtype.
"""

from __future__ import annotations

import torch
from pagedbench.conformance.adapter import Capabilities, register
from pagedbench.conformance.peers import PeerImplementation, load_kernel_module

KERNEL_MODULE = "sglang.kernels.ops.attention.merge_state"


def load():
    return load_kernel_module(KERNEL_MODULE, {})  # imports only torch and triton


@register("sglang-merge")
class SglangMergeState(PeerImplementation):
    """SGLang merge_state_triton (Triton): sglang/kernels/ops/attention/merge_state.py"""

    distribution = "sglang"
    capabilities = Capabilities(supports_num_splits=False)

    def __init__(self) -> None:
        super().__init__()
        self._kernel = load().merge_state_triton

    def merge_attn_states(self, out_a, lse_a, out_b, lse_b, *, out=None, out_lse=None):
        merged = out if out is not None and out.is_contiguous() else torch.empty_like(out_a)
        lse = out_lse if out_lse is not None and out_lse.is_contiguous() else torch.empty(
            lse_a.shape, dtype=torch.float32, device=out_a.device
        )
        self._kernel(out_a.contiguous(), lse_a.contiguous(), out_b.contiguous(), lse_b.contiguous(), merged, lse)
        if out is not None and merged is not out:
            out.copy_(merged)
            merged = out
        if out_lse is not None and lse is not out_lse:
            out_lse.copy_(lse)
            lse = out_lse
        return merged, lse
