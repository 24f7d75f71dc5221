"""Paged-attention kernels (Triton) with thin launchers, and pure-torch references (``kernels.reference``).

Cache layout, for K and for V alike::

    cache[num_blocks, block_size, num_kv_heads, head_dim]     slot = block_id * block_size + offset

Public launchers (a contract: see README and ``kernels.reference`` for the conventions):
``paged_decode``, ``paged_prefill``, ``write_kv``, ``copy_blocks``, ``contiguous_decode``,
``merge_attn_states``.
"""

from pagedbench.kernels import device  # noqa: F401  (first: decides TRITON_INTERPRET before any kernel is defined)
from pagedbench.kernels.attention import contiguous_decode, paged_decode, paged_prefill
from pagedbench.kernels.cache_ops import copy_blocks, write_kv
from pagedbench.kernels.merge import merge_attn_states

__all__ = ["contiguous_decode", "copy_blocks", "merge_attn_states", "paged_decode", "paged_prefill", "write_kv"]
