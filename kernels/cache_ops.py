"""Launchers of the KV-cache write kernels (``kernels.cache_kernels``): validate, derive sizes, launch.

Both copy raw bits: the tensors are viewed as integers of the same width, so a value (NaN payloads
included) lands in the cache byte-identical.
"""

from __future__ import annotations

import torch
import triton
from pagedbench.kernels import device
from pagedbench.kernels.cache_kernels import _copy_blocks_kernel, _write_kv_kernel
from pagedbench.kernels.validation import FP8_DTYPES, check_copy_blocks, check_write_kv

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as integers of the same width (shape and strides unchanged)."""
    return t.view(_BITS[t.element_size()])


def write_kv_tiles(num_kv_heads: int, head_dim: int, interpret: bool) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_HD) for ``_write_kv_kernel``: large tiles under the interpreter (each program
    step costs milliseconds there), small register-friendly ones on a GPU."""
    hd = triton.next_power_of_2(num_kv_heads * head_dim)
    if interpret:
        block_hd = min(hd, 1 << 14)
        return max(1, min(256, (1 << 16) // block_hd)), block_hd
    block_hd = min(hd, 1024)
    return max(1, 2048 // block_hd), block_hd


def copy_blocks_tile(block_elems: int, interpret: bool) -> int:
    """BLOCK for ``_copy_blocks_kernel`` (elements of one block per program)."""
    return min(triton.next_power_of_2(block_elems), 1 << 16 if interpret else 2048)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, validate: bool | None = None, k_scale: float | None = None,
             v_scale: float | None = None) -> None:
    """Store ``k[i], v[i]`` at slot ``slot_mapping[i]`` of ``k_cache, v_cache``; slot -1 skips token i.

    k, v ``[num_tokens, num_kv_heads, head_dim]`` (the caches' dtype); caches ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; slot_mapping int32/int64 ``[num_tokens]``, slots distinct. Slot values are
    checked (range, distinct) with ``validate=True``; ``None``: when slot_mapping is in host memory (an
    out-of-range slot there would make the interpreted kernel write outside the cache) or under
    ``PAGEDBENCH_VALIDATE=1``.

    fp8 caches (``torch.float8_e4m3fn``; k and v float32/float16/bfloat16) receive ``k / k_scale`` and
    ``v / v_scale`` (None: 1.0) rounded to nearest, saturated at +-448 (the format's largest finite value).
    """
    check_write_kv(k, v, k_cache, v_cache, slot_mapping, validate=validate, fp8=True, k_scale=k_scale,
                   v_scale=v_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_t, block_hd = write_kv_tiles(num_kv_heads, head_dim, device.backend().triton_interpret)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_kv_heads * head_dim, block_hd))
    quantize = k_cache.dtype in FP8_DTYPES
    tensors = (k, v, k_cache, v_cache) if quantize else tuple(_as_bits(t) for t in (k, v, k_cache, v_cache))
    _write_kv_kernel[grid](
        *tensors, slot_mapping,
        num_tokens, num_kv_heads, head_dim, k_cache.shape[1],
        1.0 if k_scale is None else float(k_scale), 1.0 if v_scale is None else float(v_scale),
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), slot_mapping.stride(0),
        BLOCK_T=block_t, BLOCK_HD=block_hd, QUANTIZE=quantize,
    )


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: torch.Tensor, *,
                validate: bool | None = None) -> None:
    """Copy block ``src`` onto block ``dst`` in both caches for every row (src, dst) of ``pairs``.

    pairs int32/int64 ``[num_pairs, 2]``. Destinations must be distinct and not also sources (programs
    run in no particular order). Checked, with the id range, as ``write_kv`` checks its slots.
    """
    check_copy_blocks(k_cache, v_cache, pairs, validate=validate)
    num_pairs = pairs.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if num_pairs == 0:
        return
    block_elems = block_size * num_kv_heads * head_dim
    tile = copy_blocks_tile(block_elems, device.backend().triton_interpret)
    grid = (num_pairs, triton.cdiv(block_elems, tile))
    _copy_blocks_kernel[grid](
        _as_bits(k_cache), _as_bits(v_cache), pairs,
        block_size, num_kv_heads, head_dim,
        *k_cache.stride(), *v_cache.stride(), *pairs.stride(),
        BLOCK=tile,
    )
