"""vLLM's Triton ``merge_attn_states`` (``vllm/v1/attention/ops/triton_merge_attn_states.py``) behind the adapter.

It merges two partial attentions through their log-sum-exps: the prefix part and the suffix part of
vLLM's cascade attention and of its chunked-prefill context merge (MLA, FlashAttention's prefix path).
Its LSEs are natural logs, as ours, but laid out ``[num_heads, num_tokens]``; the kernel takes their
strides, so ours (``[num_tokens, num_heads]``) go in transposed, as views::

    merge_attn_states(output=out, prefix_output=out_a, prefix_lse=lse_a.t(), suffix_output=out_b,
                      suffix_lse=lse_b.t(), output_lse=out_lse.t())

with every token merged (``prefill_tokens_with_context`` left at its default, all tokens) and no fp8
output scale. Declared: ``merge_attn_states`` only, every dtype (the kernel loads and stores the
outputs' own dtype and computes in float32).
"""

from __future__ import annotations

import torch
from pagedbench.conformance.adapter import Capabilities, register
from pagedbench.conformance.peers import PeerImplementation, load_kernel_module, vllm_stand_ins

KERNEL_MODULE = "vllm.v1.attention.ops.triton_merge_attn_states"


def load():
    return load_kernel_module(KERNEL_MODULE, vllm_stand_ins())


@register("vllm-merge")
class VllmMergeAttnStates(PeerImplementation):
    """vLLM merge_attn_states (Triton): vllm/v1/attention/ops/triton_merge_attn_states.py"""

    distribution = "vllm"
    capabilities = Capabilities(supports_num_splits=False)

    def __init__(self) -> None:
        super().__init__()
        self._kernel = load().merge_attn_states

    def merge_attn_states(self, out_a, lse_a, out_b, lse_b, *, out=None, out_lse=None):
        out = torch.empty_like(out_a) if out is None else out
        if out_lse is None:
            out_lse = torch.empty(lse_a.shape, dtype=torch.float32, device=out_a.device)
        self._kernel(
            output=out,
            prefix_output=out_a,
            prefix_lse=lse_a.t(),
            suffix_output=out_b,
            suffix_lse=lse_b.t(),
            output_lse=out_lse.t(),
        )
        return out, out_lse
