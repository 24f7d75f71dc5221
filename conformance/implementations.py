"""The built-in implementations the suite checks. Each registers itself with the adapter registry.

* ``triton`` -- ours: the Triton kernels (``kernels``) and ``refengine.BlockManager``.
* ``triton-batch-invariant`` -- the same with ``batch_invariant=True`` (rows independent of neighbours).
* ``torch``  -- the pure-torch references in ``kernels.reference`` (numerics only).
* ``flex``   -- PyTorch's own paged FlexAttention (written by nobody here; see ``flex_adapter``).
* ``mutant-*`` -- deliberately broken implementations for the mutation check (see ``mutants``);
  ``control`` is their unbroken base.

Importing this module imports no kernel and no Triton: ``triton`` and ``torch`` import ``kernels`` only
when built (ours decides the backend then, switching Triton's interpreter on where there is no GPU), so a
gate run on another project's implementation never loads them.
"""

from __future__ import annotations

import dataclasses

from pagedbench.conformance.adapter import Implementation, register
from pagedbench.conformance.capabilities import Capabilities, DispatchBoundaries
from pagedbench.conformance.flex_adapter import FlexAttentionImplementation


@register("triton")
class TritonImplementation(Implementation):
    """Ours: the ``kernels`` launchers on the backend ``kernels.device`` picked (GPU, or the CPU under
    Triton's interpreter), and ``refengine.BlockManager``."""

    capabilities = Capabilities(fp8_kv_cache=True)

    def __init__(self) -> None:
        from pagedbench.kernels import attention, device

        self.device = device.backend().torch_device
        # where the launcher's rules switch on this device: split-K stops once (sequences x 2 KV heads)
        # programs reach two per SM; a split needs MIN_KEYS_PER_SPLIT keys; tl.dot from MIN_DOT_GROUP
        # (fp16/bf16 on a GPU), and the group's tile doubles to 16 rows from a group of 9
        self.capabilities = dataclasses.replace(type(self).capabilities, dispatch_boundaries=DispatchBoundaries(
            decode_batch_sizes=(attention.parallelism(),), context_lens=(attention.MIN_KEYS_PER_SPLIT,),
            gqa_groups=(attention.MIN_DOT_GROUP, 9)))

    def describe(self):
        from pagedbench.kernels import device

        return {"device": str(self.device), "backend": device.describe()}

    def block_manager(self, num_blocks, block_size, *, enable_prefix_caching=False):
        from pagedbench.refengine import BlockManager

        return BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)

    def paged_decode(self, *args, **kwargs):
        from pagedbench.kernels import paged_decode

        return paged_decode(*args, **kwargs)

    def paged_prefill(self, *args, **kwargs):
        from pagedbench.kernels import paged_prefill

        return paged_prefill(*args, **kwargs)

    def contiguous_decode(self, *args, **kwargs):
        from pagedbench.kernels import contiguous_decode

        return contiguous_decode(*args, **kwargs)

    def merge_attn_states(self, *args, **kwargs):
        from pagedbench.kernels import merge_attn_states

        return merge_attn_states(*args, **kwargs)

    def write_kv(self, *args, **kwargs):
        from pagedbench.kernels import write_kv

        return write_kv(*args, **kwargs)

    def copy_blocks(self, *args, **kwargs):
        from pagedbench.kernels import copy_blocks

        return copy_blocks(*args, **kwargs)

    def copy_blocks_between(self, src_k_cache, src_v_cache, dst_k_cache, dst_v_cache, pairs):
        from pagedbench.refengine.kv.swap_copy import copy_blocks_between

        copy_blocks_between([(src_k_cache, src_v_cache)], [(dst_k_cache, dst_v_cache)], pairs)


@register("triton-batch-invariant")
class TritonBatchInvariantImplementation(TritonImplementation):
    """Ours with ``batch_invariant=True``: one split per sequence and tiles chosen for no batch, so a
    sequence's rows do not depend on its neighbours (the launchers refuse a split count then)."""

    capabilities = Capabilities(fp8_kv_cache=True, supports_num_splits=False, batch_invariant_dispatch=True)

    def paged_decode(self, *args, **kwargs):
        return super().paged_decode(*args, batch_invariant=True, **kwargs)

    def paged_prefill(self, *args, **kwargs):
        return super().paged_prefill(*args, batch_invariant=True, **kwargs)


@register("torch")
class TorchReferenceImplementation(Implementation):
    """The pure-torch references of ``kernels.reference`` (on the CPU; one sequence at a time, so
    invariant to its neighbours)."""

    capabilities = Capabilities(fp8_kv_cache=True, batch_invariant_dispatch=True)

    def paged_decode(self, *args, **kwargs):
        from pagedbench.kernels import reference

        return reference.paged_decode(*args, **kwargs)

    def paged_prefill(self, *args, **kwargs):
        from pagedbench.kernels import reference

        return reference.paged_prefill(*args, **kwargs)

    def contiguous_decode(self, *args, **kwargs):
        from pagedbench.kernels import reference

        return reference.contiguous_decode(*args, **kwargs)

    def merge_attn_states(self, *args, **kwargs):
        from pagedbench.kernels import reference

        return reference.merge_attn_states(*args, **kwargs)

    def write_kv(self, *args, **kwargs):
        from pagedbench.kernels import reference

        return reference.write_kv(*args, **kwargs)

    def copy_blocks(self, *args, **kwargs):
        from pagedbench.kernels import reference

        return reference.copy_blocks(*args, **kwargs)


register("flex")(FlexAttentionImplementation)

