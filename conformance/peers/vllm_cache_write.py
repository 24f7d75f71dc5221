"""vLLM's Triton KV-cache write, ``triton_reshape_and_cache_flash``
(``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``), as ``write_kv``.

It stores each new token's key and value at its slot of a ``[num_blocks, block_size, num_kv_heads,
head_size]`` cache pair (the "flash" layout, ours), skipping slots below 0 (vLLM's padding tokens), so
our caches and slot mapping go in as they are. The arguments are those vLLM's Triton backend passes for
an unquantized cache: ``kv_cache_dtype="auto"`` and unit ``k_scale``/``v_scale`` tensors.

Declared: ``write_kv`` only (no attention, no ``copy_blocks``), every dtype (the kernel copies
elements). fp8 caches are not declared: vLLM's launcher refuses them off SM89+ GPUs. Its convention is
ours (it stores ``x / k_scale``), but under Triton's interpreter its fp8 store rounds values just past half
the smallest e4m3 subnormal to 0 (the fp8 family's write case fails there on every dtype), which is not
checked on a GPU. Under Triton's interpreter, caches past 2^31 elements are refused
("not supported"), as for ``vllm-paged-decode``: the kernel's strides are annotated ``tl.int64``, which
the interpreter ignores (it types an integer argument by its value), so ``head * head_stride`` wraps
there where the compiled kernel computes in 64 bits. The kernel takes one stride per token row of ``key``
and ``value`` (its heads and dims one dense run, ``tile_pos``), block, slot and head strides for the
caches (their last dim dense), and none for ``slot_mapping``: views strided where it takes no stride are
refused ("not supported"; given to the kernel they are read or written at the wrong elements).
"""

from __future__ import annotations

import torch
from pagedbench.conformance.adapter import Capabilities, NotSupported, register
from pagedbench.conformance.peers import (
    PeerImplementation,
    load_kernel_module,
    refuse_unread_strides,
    vllm_stand_ins,
)

KERNEL_MODULE = "vllm.v1.attention.ops.triton_reshape_and_cache_flash"


def load():
    return load_kernel_module(KERNEL_MODULE, vllm_stand_ins())


@register("vllm-cache-write")
class VllmCacheWrite(PeerImplementation):
    """vLLM triton_reshape_and_cache_flash (Triton): vllm/v1/attention/ops/triton_reshape_and_cache_flash.py"""

    distribution = "vllm"
    capabilities = Capabilities(returns_lse=False, supports_num_splits=False)

    def __init__(self) -> None:
        super().__init__()
        self._kernel = load().triton_reshape_and_cache_flash

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        refuse_unread_strides(self.name, 1, "slot_mapping_ptr + token_idx", slot_mapping=slot_mapping)
        refuse_unread_strides(self.name, 2, "key_ptr + token_idx * key_stride + tile_pos", k=k, v=v)
        refuse_unread_strides(self.name, 1, "... + cur_head * head_stride + cur_dim", k_cache=k_cache, v_cache=v_cache)
        if self.interpreted and k_cache.numel() >= 2**31:
            raise NotSupported(
                "vllm-cache-write: offsets past 2^31 elements under Triton's interpreter, which "
                "ignores the kernel's tl.int64 stride annotations (judged on a GPU only)"
            )
        unit = torch.ones(1, dtype=torch.float32, device=k.device)
        self._kernel(k, v, k_cache, v_cache, slot_mapping, "auto", unit, unit)
