"""The engine's batched torch attention (``refengine.model.batched_attention``) behind the adapter.

It is what the engine runs on the CPU by default (backend ``"torch-batched"``): the step's K/V gathered
through the block tables into padded tensors, one masked ``scaled_dot_product_attention`` per group of
sequences. Registered as ``torch-batched``; importing this module registers it::

    pytest conformance -p pagedbench.conformance.batched_torch_adapter --impl torch-batched

``contiguous_decode`` and ``copy_blocks`` are not part of that backend: not supported.
"""

from __future__ import annotations

from pagedbench.conformance.adapter import Implementation, register
from pagedbench.conformance.capabilities import Capabilities


@register("torch-batched")
class BatchedTorchImplementation(Implementation):
    """``paged_decode`` / ``paged_prefill`` / ``write_kv`` of the engine's batched torch backend (CPU)."""

    # Each sequence's keys are padded to the longest in its group, and SDPA's blocked reductions follow
    # the padded shape, so a sequence's rows may differ in the last bits alone and in a batch (seen in
    # prefill, fp16 and fp32); they are still judged against the oracle within the dtype's bounds.
    capabilities = Capabilities(batch_invariant=False, fp8_kv_cache=True)

    def paged_decode(self, *args, **kwargs):
        from pagedbench.refengine.model.batched_attention import paged_decode

        return paged_decode(*args, **kwargs)

    def paged_prefill(self, *args, **kwargs):
        from pagedbench.refengine.model.batched_attention import paged_prefill

        return paged_prefill(*args, **kwargs)

    def write_kv(self, *args, **kwargs):
        from pagedbench.refengine.model.batched_attention import write_kv

        return write_kv(*args, **kwargs)
