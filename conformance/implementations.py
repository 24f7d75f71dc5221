"""The built-in implementations the suite checks. Each registers itself with the adapter registry.

* ``triton`` -- ours: the Triton kernels (``kernels``) and ``refengine.BlockManager``.
* ``torch``  -- the pure-torch references in ``kernels.reference`` (numerics only).
* ``flex``   -- PyTorch's own paged FlexAttention (written by nobody here).
"""

from __future__ import annotations

from conformance.adapter import Implementation, register


@register("triton")
class TritonImplementation(Implementation):
    def block_manager(self, num_blocks, block_size, *, enable_prefix_caching=False):
        from refengine import BlockManager

        return BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)

    def paged_decode(self, *args, **kwargs):
        from kernels import paged_decode

        return paged_decode(*args, **kwargs)

    def paged_prefill(self, *args, **kwargs):
        from kernels import paged_prefill

        return paged_prefill(*args, **kwargs)

    def contiguous_decode(self, *args, **kwargs):
        from kernels import contiguous_decode

        return contiguous_decode(*args, **kwargs)

    def write_kv(self, *args, **kwargs):
        from kernels import write_kv

        return write_kv(*args, **kwargs)

    def copy_blocks(self, *args, **kwargs):
        from kernels import copy_blocks

        return copy_blocks(*args, **kwargs)


@register("torch")
class TorchReferenceImplementation(Implementation):
    def paged_decode(self, *args, **kwargs):
        from kernels import reference

        return reference.paged_decode(*args, **kwargs)

    def paged_prefill(self, *args, **kwargs):
        from kernels import reference

        return reference.paged_prefill(*args, **kwargs)

    def contiguous_decode(self, *args, **kwargs):
        from kernels import reference

        return reference.contiguous_decode(*args, **kwargs)

    def write_kv(self, *args, **kwargs):
        from kernels import reference

        return reference.write_kv(*args, **kwargs)

    def copy_blocks(self, *args, **kwargs):
        from kernels import reference

        return reference.copy_blocks(*args, **kwargs)


@register("flex")
class FlexAttentionImplementation(Implementation):
    """PyTorch's paged FlexAttention (``torch.nn.attention.experimental._paged_attention``)."""

    # TODO(numerics helper): adapt paged_decode / paged_prefill; report honestly what fails.
