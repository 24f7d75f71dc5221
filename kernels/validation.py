"""Argument checks shared by the Triton launchers and the torch references.

Two levels:

* always (cheap, no device sync): types, ranks, shapes, dtypes and devices of every tensor, the GQA
  ratio, ``scale`` / ``sliding_window`` / ``num_splits`` values, and a caller's ``out=``;
* on request (``validate=True``; when ``validate`` is None: by default when the index tensors (block
  tables, slot mapping, copy pairs, contiguous lengths) live in host memory, and everywhere under the
  environment variable ``PAGEDBENCH_VALIDATE=1``; these read the index tensors back to the host):
  block ids in range for every block-table entry a sequence uses, ``0 <= seq_lens <= max_blocks *
  block_size``, ``cu_seqlens_q`` starting at 0, non-decreasing and ending at ``total_q_tokens``, every
  query length ``<= seq_lens``, slots in range and distinct, copy pairs in range with distinct
  destinations that are not also sources.

Every failure raises :class:`KernelInputError` (a ``ValueError``) or :class:`KernelTypeError` /
:class:`KernelDtypeError` (also ``TypeError``: an argument of the wrong type or dtype) naming the
argument, what was expected and what was given. Nothing is launched or written before the checks pass.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

ENV_VAR = "PAGEDBENCH_VALIDATE"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REFERENCE_DTYPES = (*KERNEL_DTYPES, torch.float64)  # the references also compute in float64
INDEX_DTYPES = (torch.int32, torch.int64)
#: KV-cache dtypes stored quantized, read back as ``value * scale`` (per-tensor ``k_scale`` / ``v_scale``)
FP8_DTYPES = (torch.float8_e4m3fn,)
#: the largest finite float8_e4m3fn value: a write saturates to +-FP8_MAX
FP8_MAX = 448.0


class KernelInputError(ValueError):
    """A kernel argument of the wrong shape, device or value."""


class KernelTypeError(KernelInputError, TypeError):
    """A kernel argument of the wrong Python type (a list where a tensor goes, a float ``num_splits``)."""


class KernelDtypeError(KernelTypeError):
    """A kernel argument of the wrong dtype (or not a tensor at all)."""


@dataclass(frozen=True, slots=True)
class PagedShape:
    """Sizes derived from a paged attention call's arguments."""

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    max_blocks: int  # block-table columns: capacity of a sequence is max_blocks * block_size tokens

    @property
    def group_size(self) -> int:
        """Query heads per KV head (query head h reads KV head h // group_size)."""
        return self.num_heads // self.num_kv_heads


def validation_enabled(validate: bool | None, on: torch.Tensor | None = None) -> bool:
    """``validate`` if given; else True when ``PAGEDBENCH_VALIDATE`` is 1/true/yes, or when the index
    tensor ``on`` lives in host memory: there reading it back costs no device sync, and an out-of-range
    index would make the interpreted kernel read outside the cache (a crash, not an error)."""
    if validate is not None:
        if not isinstance(validate, bool):
            raise KernelTypeError(f"validate must be True, False or None; got {validate!r}")
        return validate
    if on is not None and on.device.type == "cpu":
        return True
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def _dtype_name(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(t: object, name: str, ndim: int, layout: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """``t`` is a tensor of rank ``ndim`` (described by ``layout``) with one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise KernelDtypeError(f"{name} must be a torch.Tensor {layout}; got {type(t).__name__}")
    if t.dim() != ndim:
        raise KernelInputError(f"{name} must be {ndim}-D {layout}; got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise KernelDtypeError(f"{name} must have dtype {_dtype_name(dtypes)}; got {t.dtype}")


def check_device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise KernelInputError(f"{name} must be on {device} (the device of q); got {t.device}")


def check_same(t: torch.Tensor, name: str, like: torch.Tensor, like_name: str) -> None:
    """``t`` has exactly the shape and dtype of ``like``."""
    if t.shape != like.shape:
        raise KernelInputError(f"{name} must have the shape of {like_name} {tuple(like.shape)}; "
                               f"got {tuple(t.shape)}")
    if t.dtype != like.dtype:
        raise KernelDtypeError(f"{name} must have the dtype of {like_name} ({like.dtype}); got {t.dtype}")


def check_dim(name: str, what: str, expected: object, actual: object) -> None:
    if expected != actual:
        raise KernelInputError(f"{name}: {what} must be {expected}; got {actual}")


def check_out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> None:
    """A caller's ``out=`` has the output's exact shape, dtype and device (``None`` passes)."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise KernelDtypeError(f"out must be a torch.Tensor or None; got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise KernelInputError(f"out must have shape {tuple(shape)}; got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise KernelDtypeError(f"out must have dtype {dtype} (the dtype of q); got {out.dtype}")
    check_device(out, "out", device)


def check_options(scale: float | None, sliding_window: int | None, num_splits: int | None) -> None:
    """``scale`` a finite number, ``sliding_window`` and ``num_splits`` integers >= 1 (or None)."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise KernelTypeError(f"scale must be a finite number or None; got {scale!r}")
    if scale is not None and not math.isfinite(scale):
        raise KernelInputError(f"scale must be a finite number or None; got {scale!r}")
    for name, value in (("sliding_window", sliding_window), ("num_splits", num_splits)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise KernelTypeError(f"{name} must be an integer >= 1 or None; got {value!r}")
        if value is not None and value < 1:
            raise KernelInputError(f"{name} must be an integer >= 1 or None; got {value!r}")


def check_batch_invariant(batch_invariant, num_splits: int | None = None) -> None:
    """``batch_invariant`` a bool; with it, ``num_splits`` None or 1 (a split count chosen for the batch
    would change a sequence's rounding)."""
    if not isinstance(batch_invariant, bool):
        raise KernelTypeError(f"batch_invariant must be True or False; got {batch_invariant!r}")
    if batch_invariant and num_splits not in (None, 1):
        raise KernelInputError(f"batch_invariant=True runs one split per sequence; num_splits must be None or 1, "
                               f"got {num_splits!r}")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, dtypes: tuple[torch.dtype, ...],
                     device: torch.device) -> None:
    """K and V caches: 4-D ``[num_blocks, block_size, num_kv_heads, head_dim]``, identical shape/dtype."""
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_tensor(k_cache, "k_cache", 4, layout, dtypes)
    check_tensor(v_cache, "v_cache", 4, layout, dtypes)
    check_same(v_cache, "v_cache", k_cache, "k_cache")
    check_device(k_cache, "k_cache", device)
    check_device(v_cache, "v_cache", device)
    for i, what in ((1, "block_size"), (2, "num_kv_heads"), (3, "head_dim")):
        if k_cache.shape[i] < 1:
            raise KernelInputError(f"k_cache: {what} must be >= 1; got {k_cache.shape[i]}")


def check_kv_scales(k_cache: torch.Tensor, k_scale, v_scale) -> None:
    """With fp8 caches, ``k_scale`` / ``v_scale`` are None (1.0) or finite numbers > 0; with any other cache
    dtype they must be None (nothing would apply them)."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is None:
            continue
        if k_cache.dtype not in FP8_DTYPES:
            raise KernelInputError(f"{name} applies to fp8 caches only ({_dtype_name(FP8_DTYPES)}); the cache is "
                                   f"{k_cache.dtype}, got {name}={value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KernelTypeError(f"{name} must be a finite number > 0 or None; got {value!r}")
        if not (math.isfinite(value) and value > 0):
            raise KernelInputError(f"{name} must be a finite number > 0 or None; got {value!r}")


def check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, *, q_layout: str, dtypes: tuple[torch.dtype, ...],
                fp8: bool = False) -> PagedShape:
    """The checks common to paged decode and prefill; returns the derived sizes. ``fp8``: the caches may
    also be fp8 (whatever q's dtype)."""
    check_tensor(q, "q", 3, q_layout, dtypes)
    device = q.device
    check_cache_pair(k_cache, v_cache, (*dtypes, *FP8_DTYPES) if fp8 else dtypes, device)
    if k_cache.dtype != q.dtype and not (fp8 and k_cache.dtype in FP8_DTYPES):
        raise KernelDtypeError(f"k_cache must have the dtype of q ({q.dtype}); got {k_cache.dtype}")
    check_tensor(block_tables, "block_tables", 2, "[num_seqs, max_blocks]", (torch.int32,))
    check_tensor(seq_lens, "seq_lens", 1, "[num_seqs]", (torch.int32,))
    check_device(block_tables, "block_tables", device)
    check_device(seq_lens, "seq_lens", device)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    check_dim("q", "head_dim (q.shape[2]) = k_cache.shape[3]", head_dim, q.shape[2])
    if num_heads < 1 or num_heads % num_kv_heads:
        raise KernelInputError(f"q: num_heads (q.shape[1]) must be a positive multiple of num_kv_heads "
                               f"(k_cache.shape[2] = {num_kv_heads}); got {num_heads}")
    num_seqs = seq_lens.shape[0]
    check_dim("block_tables", "num_seqs (block_tables.shape[0]) = seq_lens.shape[0]", num_seqs,
              block_tables.shape[0])
    return PagedShape(num_seqs, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
                      block_tables.shape[1])


def check_table_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, shape: PagedShape) -> None:
    """(validate) lengths within the table's capacity; every used block id in ``[0, num_blocks)``."""
    lens = seq_lens.detach().to("cpu", torch.int64)
    capacity = shape.max_blocks * shape.block_size
    bad = ((lens < 0) | (lens > capacity)).nonzero()
    if bad.numel():
        s = int(bad[0, 0])
        raise KernelInputError(f"seq_lens[{s}] must be in [0, {capacity}] (max_blocks {shape.max_blocks} x "
                               f"block_size {shape.block_size}); got {int(lens[s])}")
    table = block_tables.detach().to("cpu", torch.int64)
    blocks_used = (lens + shape.block_size - 1) // shape.block_size
    used = torch.arange(shape.max_blocks)[None, :] < blocks_used[:, None]
    bad = (used & ((table < 0) | (table >= shape.num_blocks))).nonzero()
    if bad.numel():
        s, j = int(bad[0, 0]), int(bad[0, 1])
        raise KernelInputError(f"block_tables[{s}, {j}] must be a block id in [0, {shape.num_blocks}) "
                               f"(sequence {s} uses it: seq_len {int(lens[s])}); got {int(table[s, j])}")


def check_query_starts(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, total_q: int) -> None:
    """(validate) ``cu_seqlens_q`` is 0, non-decreasing, ends at total_q; each query length <= seq_len."""
    cu = cu_seqlens_q.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise KernelInputError(f"cu_seqlens_q[0] must be 0; got {int(cu[0])}")
    q_lens = cu[1:] - cu[:-1]
    bad = (q_lens < 0).nonzero()
    if bad.numel():
        s = int(bad[0, 0])
        raise KernelInputError(f"cu_seqlens_q must be non-decreasing; got cu_seqlens_q[{s}] = {int(cu[s])} > "
                               f"cu_seqlens_q[{s + 1}] = {int(cu[s + 1])}")
    if int(cu[-1]) != total_q:
        raise KernelInputError(f"cu_seqlens_q[-1] must equal total_q_tokens (q.shape[0] = {total_q}); "
                               f"got {int(cu[-1])}")
    lens = seq_lens.detach().to("cpu", torch.int64)
    bad = (q_lens > lens).nonzero()
    if bad.numel():
        s = int(bad[0, 0])
        raise KernelInputError(f"sequence {s}: query length (cu_seqlens_q[{s + 1}] - cu_seqlens_q[{s}]) must "
                               f"be <= seq_lens[{s}] = {int(lens[s])} (queries are the last tokens of the "
                               f"sequence, already in the cache); got {int(q_lens[s])}")


# --- one entry point per operation (the launchers and the references call these) ---------------------

def check_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale, sliding_window, num_splits,
                       out, validate, dtypes=KERNEL_DTYPES, fp8=False, k_scale=None, v_scale=None) -> PagedShape:
    """All checks of ``paged_decode`` (see the module docstring); returns the derived sizes. ``fp8``: fp8
    caches are accepted, with their scales."""
    check_options(scale, sliding_window, num_splits)
    shape = check_paged(q, k_cache, v_cache, block_tables, seq_lens,
                        q_layout="[num_seqs, num_heads, head_dim]", dtypes=dtypes, fp8=fp8)
    check_kv_scales(k_cache, k_scale, v_scale)
    check_dim("q", "num_seqs (q.shape[0]) = seq_lens.shape[0]", shape.num_seqs, q.shape[0])
    check_out(out, tuple(q.shape), q.dtype, q.device)
    if validation_enabled(validate, block_tables):
        check_table_values(block_tables, seq_lens, shape)
    return shape


def check_paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale, sliding_window,
                        out, validate, dtypes=KERNEL_DTYPES, fp8=False, k_scale=None, v_scale=None) -> PagedShape:
    """All checks of ``paged_prefill`` (see the module docstring); returns the derived sizes. ``fp8`` as
    :func:`check_paged_decode`."""
    check_options(scale, sliding_window, None)
    shape = check_paged(q, k_cache, v_cache, block_tables, seq_lens,
                        q_layout="[total_q_tokens, num_heads, head_dim]", dtypes=dtypes, fp8=fp8)
    check_kv_scales(k_cache, k_scale, v_scale)
    check_tensor(cu_seqlens_q, "cu_seqlens_q", 1, "[num_seqs + 1]", (torch.int32,))
    check_device(cu_seqlens_q, "cu_seqlens_q", q.device)
    check_dim("cu_seqlens_q", "length (num_seqs + 1)", shape.num_seqs + 1, cu_seqlens_q.shape[0])
    check_out(out, tuple(q.shape), q.dtype, q.device)
    if validation_enabled(validate, block_tables):
        check_table_values(block_tables, seq_lens, shape)
        check_query_starts(cu_seqlens_q, seq_lens, q.shape[0])
    return shape


def check_contiguous_decode(q, k, v, seq_lens, *, scale, out, validate=None, dtypes=KERNEL_DTYPES) -> None:
    """All checks of ``contiguous_decode``; lengths in ``[0, k.shape[1]]`` when validating (see
    :func:`validation_enabled`: by default when seq_lens is in host memory)."""
    check_options(scale, None, None)
    check_tensor(q, "q", 3, "[num_seqs, num_heads, head_dim]", dtypes)
    layout = "[num_seqs, max_len, num_kv_heads, head_dim]"
    check_tensor(k, "k", 4, layout, dtypes)
    check_tensor(v, "v", 4, layout, dtypes)
    check_same(v, "v", k, "k")
    if k.dtype != q.dtype:
        raise KernelDtypeError(f"k must have the dtype of q ({q.dtype}); got {k.dtype}")
    check_tensor(seq_lens, "seq_lens", 1, "[num_seqs]", (torch.int32,))
    for t, name in ((k, "k"), (v, "v"), (seq_lens, "seq_lens")):
        check_device(t, name, q.device)
    num_seqs, num_heads, head_dim = q.shape
    check_dim("k", "num_seqs (k.shape[0]) = q.shape[0]", num_seqs, k.shape[0])
    check_dim("seq_lens", "num_seqs (seq_lens.shape[0]) = q.shape[0]", num_seqs, seq_lens.shape[0])
    check_dim("k", "head_dim (k.shape[3]) = q.shape[2]", head_dim, k.shape[3])
    if k.shape[2] < 1 or num_heads < 1 or num_heads % k.shape[2]:
        raise KernelInputError(f"q: num_heads (q.shape[1]) must be a positive multiple of num_kv_heads "
                               f"(k.shape[2] = {k.shape[2]}); got {num_heads}")
    check_out(out, tuple(q.shape), q.dtype, q.device)
    if validation_enabled(validate, seq_lens):
        lens = seq_lens.detach().to("cpu", torch.int64)
        bad = ((lens < 0) | (lens > k.shape[1])).nonzero()
        if bad.numel():
            s = int(bad[0, 0])
            raise KernelInputError(f"seq_lens[{s}] must be in [0, {k.shape[1]}] (k.shape[1]); "
                                   f"got {int(lens[s])}")


def check_write_kv(k, v, k_cache, v_cache, slot_mapping, *, validate=None, dtypes=KERNEL_DTYPES, fp8=False,
                   k_scale=None, v_scale=None) -> None:
    """All checks of ``write_kv``; slot values (range, distinct) when validating (see
    :func:`validation_enabled`: by default when slot_mapping is in host memory). ``fp8``: fp8 caches are
    accepted (k and v of any of ``dtypes``), with their scales."""
    check_tensor(k, "k", 3, "[num_tokens, num_kv_heads, head_dim]", dtypes)
    check_tensor(v, "v", 3, "[num_tokens, num_kv_heads, head_dim]", dtypes)
    check_same(v, "v", k, "k")
    check_cache_pair(k_cache, v_cache, (*dtypes, *FP8_DTYPES) if fp8 else dtypes, k.device)
    check_device(v, "v", k.device)
    check_kv_scales(k_cache, k_scale, v_scale)
    if k_cache.dtype != k.dtype and not (fp8 and k_cache.dtype in FP8_DTYPES):
        raise KernelDtypeError(f"k_cache must have the dtype of k ({k.dtype}); got {k_cache.dtype}")
    check_dim("k", "[num_kv_heads, head_dim] (k.shape[1:]) = k_cache.shape[2:]",
              tuple(k_cache.shape[2:]), tuple(k.shape[1:]))
    check_tensor(slot_mapping, "slot_mapping", 1, "[num_tokens]", INDEX_DTYPES)
    check_device(slot_mapping, "slot_mapping", k.device)
    check_dim("slot_mapping", "num_tokens (slot_mapping.shape[0]) = k.shape[0]", k.shape[0],
              slot_mapping.shape[0])
    if validation_enabled(validate, slot_mapping):
        slots = slot_mapping.detach().to("cpu", torch.int64)
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        bad = ((slots < -1) | (slots >= num_slots)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise KernelInputError(f"slot_mapping[{i}] must be -1 (skip) or a slot in [0, {num_slots}); "
                                   f"got {int(slots[i])}")
        used = slots[slots >= 0]
        if used.unique().numel() != used.numel():
            raise KernelInputError("slot_mapping must not repeat a slot (other than -1)")


def check_copy_blocks(k_cache, v_cache, pairs, *, validate=None, dtypes=KERNEL_DTYPES) -> None:
    """All checks of ``copy_blocks`` (caches of ``dtypes`` or fp8: it copies bytes); block ids (range,
    distinct destinations that are not sources) when validating (see :func:`validation_enabled`: by
    default when pairs is in host memory)."""
    dtypes = (*dtypes, *FP8_DTYPES)
    check_tensor(k_cache, "k_cache", 4, "[num_blocks, block_size, num_kv_heads, head_dim]", dtypes)
    check_cache_pair(k_cache, v_cache, dtypes, k_cache.device)
    check_tensor(pairs, "pairs", 2, "[num_pairs, 2] of (src, dst) block ids", INDEX_DTYPES)
    check_device(pairs, "pairs", k_cache.device)
    check_dim("pairs", "pairs.shape[1] (src, dst)", 2, pairs.shape[1])
    if validation_enabled(validate, pairs):
        p = pairs.detach().to("cpu", torch.int64)
        num_blocks = k_cache.shape[0]
        bad = ((p < 0) | (p >= num_blocks)).nonzero()
        if bad.numel():
            i, j = int(bad[0, 0]), int(bad[0, 1])
            raise KernelInputError(f"pairs[{i}, {j}] must be a block id in [0, {num_blocks}); "
                                   f"got {int(p[i, j])}")
        src, dst = p[:, 0], p[:, 1]
        if dst.unique().numel() != dst.numel():
            raise KernelInputError("pairs: destination blocks must be distinct")
        if torch.isin(dst, src).any():
            raise KernelInputError("pairs: a destination block must not also be a source")


def check_merge_attn_states(out_a, lse_a, out_b, lse_b, *, out, out_lse, dtypes=KERNEL_DTYPES) -> None:
    """All checks of ``merge_attn_states``: outputs ``[num_tokens, num_heads, head_dim]`` of one dtype,
    LSEs ``[num_tokens, num_heads]`` float32 (float64 beside float64 outputs), all on one device; a
    caller's ``out=`` / ``out_lse=`` shaped and typed like the result. No value is read (no sync)."""
    layout = "[num_tokens, num_heads, head_dim]"
    check_tensor(out_a, "out_a", 3, layout, dtypes)
    check_tensor(out_b, "out_b", 3, layout, dtypes)
    check_same(out_b, "out_b", out_a, "out_a")
    for i, what in ((1, "num_heads"), (2, "head_dim")):
        if out_a.shape[i] < 1:
            raise KernelInputError(f"out_a: {what} (out_a.shape[{i}]) must be >= 1; got {out_a.shape[i]}")
    lse_dtype = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    for t, name in ((lse_a, "lse_a"), (lse_b, "lse_b")):
        check_tensor(t, name, 2, "[num_tokens, num_heads]", (lse_dtype,))
        check_dim(name, "shape [num_tokens, num_heads] (out_a.shape[:2])", tuple(out_a.shape[:2]), tuple(t.shape))
    for t, name in ((out_b, "out_b"), (lse_a, "lse_a"), (lse_b, "lse_b"), (out, "out"), (out_lse, "out_lse")):
        if isinstance(t, torch.Tensor) and t.device != out_a.device:
            raise KernelInputError(f"{name} must be on {out_a.device} (the device of out_a); got {t.device}")
    if out is not None and isinstance(out, torch.Tensor) and out.dtype != out_a.dtype:
        raise KernelDtypeError(f"out must have dtype {out_a.dtype} (the dtype of out_a); got {out.dtype}")
    check_out(out, tuple(out_a.shape), out_a.dtype, out_a.device)
    if out_lse is not None:
        if not isinstance(out_lse, torch.Tensor):
            raise KernelDtypeError(f"out_lse must be a torch.Tensor or None; got {type(out_lse).__name__}")
        check_dim("out_lse", "shape [num_tokens, num_heads]", tuple(out_a.shape[:2]), tuple(out_lse.shape))
        if out_lse.dtype != lse_dtype:
            raise KernelDtypeError(f"out_lse must have dtype {lse_dtype}; got {out_lse.dtype}")
