"""Launchers of the attention kernels (``kernels.attention_kernels``): validate -> derive sizes ->
allocate or check ``out=`` -> launch. No math here; conventions (GQA mapping, window, LSE, empty rows)
are those of ``kernels.reference``, whose docstring states them.

Tile sizes are chosen by small explicit functions, so tests run one pinned config: large tiles under
the Triton interpreter, where every program step costs milliseconds, and register-sized tiles on a GPU;
on a GPU prefill is autotuned instead over ``PREFILL_CONFIGS`` (beside the kernel, with its prune
filter).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from pagedbench.kernels import device
from pagedbench.kernels.attention_kernels import (
    PREFILL_CONFIGS,
    _decode_partial_kernel,
    _decode_reduce_kernel,
    _prefill_kernel,
    prune_prefill_configs,
)
from pagedbench.kernels.validation import (
    FP8_DTYPES,
    check_batch_invariant,
    check_contiguous_decode,
    check_paged_decode,
    check_paged_prefill,
)


@functools.cache
def _check_interpreter_mode() -> None:
    """Triton fixes, as it is imported, whether its own library functions (``tl.cdiv`` ...) are
    interpreted; if triton was imported before ``kernels`` switched the interpreter on, our interpreted
    kernels would fail deep inside with "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    import triton.language.standard as tl_standard
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(_decode_partial_kernel, InterpretedFunction) and not isinstance(tl_standard.cdiv,
                                                                                  InterpretedFunction):
        raise RuntimeError("triton was imported before kernels turned on its interpreter (no GPU here): "
                           "import kernels before triton, or set TRITON_INTERPRET=1 in the environment")

MIN_KEYS_PER_SPLIT = 512  # a split shorter than this costs more to merge than it gains
MAX_SPLITS = 16
#: the context the tiles of ``batch_invariant=True`` are chosen for, whatever the batch's longest: tiles
#: (and with them the order of every reduction) then depend on nothing a neighbour can change
INVARIANT_CONTEXT = 1 << 20


SPECIALISED_BLOCK_SIZES = (16, 32, 64, 128)  # compiled with block_size a constexpr (shifts, masks)
MIN_DOT_GROUP = 4  # decode uses tl.dot from this GQA group up: padded to 16 rows it wastes at most 4x


def block_size_constexpr(block_size: int) -> int:
    """The kernels' BLOCK_SIZE: the block size itself when specialised, else 0 (the runtime path)."""
    return block_size if block_size in SPECIALISED_BLOCK_SIZES else 0


def decode_uses_dot(group_size: int, interpret: bool, dtype_bytes: int = 2) -> bool:
    """tl.dot (tensor cores) on a GPU for fp16/bf16 groups of MIN_DOT_GROUP or more (float32 ieee
    products get no tensor cores, and its 16-row tiles spill); broadcast products under the
    interpreter, where tl.dot is numpy's slow loop (tests force it through here)."""
    return not interpret and dtype_bytes == 2 and group_size >= MIN_DOT_GROUP


def prefill_uses_dot(interpret: bool) -> bool:
    """tl.dot on a GPU; broadcast products under the interpreter (tests force tl.dot through here)."""
    return not interpret


@dataclass(frozen=True, slots=True)
class DecodeTiles:
    block_g: int  # query heads of one KV head handled together (power of two >= group size; >= 16 for dot)
    block_n: int  # keys per tile step
    block_d: int  # head_dim padded to a power of two (>= 16 for dot)
    num_warps: int
    use_dot: bool  # products by tl.dot rather than broadcast multiply + sum
    num_stages: int | None = None  # software-pipelining depth of the key loop (None: Triton's default)


def decode_tiles(group_size: int, head_dim: int, max_context: int, interpret: bool,
                 use_dot: bool = False) -> DecodeTiles:
    """Tiles of the decode kernel.

    Broadcast path, whose product holds block_g * block_n * block_d floats: up to 2^18 under the
    interpreter (fewer, larger steps); 2^13 over 8 warps on a GPU, 2^12 from 16 rows (no register
    spills on sm_90 for head_dim 32..256 and groups 1..16, checked with ``python -m kernels.compile_check``).
    Dot path: the group padded to 16 rows; up to head_dim 128, 64 keys a step over 4 warps, the fastest
    plan of ``bench.decode_sweep`` on an H200 (paged 96% of copy bandwidth, 1.03x contiguous, where 32
    keys over 8 warps gave 54% and 1.60x: ``results/gpu/decode_plans.md``); head_dim 256 (unmeasured),
    16 keys over 8 warps."""
    if use_dot:
        block_g = max(16, triton.next_power_of_2(group_size))
        block_d = max(16, triton.next_power_of_2(head_dim))
        wide = block_d > 128
        block_n = max(16, min(16 if wide else 64, triton.next_power_of_2(max(max_context, 1))))
        return DecodeTiles(block_g, block_n, block_d, 8 if wide else 4, True)
    block_g, block_d = triton.next_power_of_2(group_size), triton.next_power_of_2(head_dim)
    # from 16 rows the query and accumulator tiles alone take 16 registers a thread: half the product
    budget = 1 << 18 if interpret else 1 << (13 if block_g < 16 else 12)
    block_n = max(1, budget // (block_g * block_d))
    block_n = min(block_n, 256 if interpret else 128, triton.next_power_of_2(max(max_context, 1)))
    return DecodeTiles(block_g, 1 << (block_n.bit_length() - 1), block_d, 4 if interpret else 8, False)


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    block_r: int  # rows per tile: block_r // block_g queries x block_g heads
    block_g: int  # query heads of one KV head (power of two >= group size)
    block_n: int  # keys per tile step
    block_d: int  # head_dim padded to a power of two (>= 16)
    num_warps: int
    use_dot: bool  # products by tl.dot rather than broadcast multiply + sum

    @property
    def block_m(self) -> int:
        """Queries per tile."""
        return self.block_r // self.block_g


def prefill_tiles(group_size: int, head_dim: int, max_q_len: int, interpret: bool,
                  use_dot: bool | None = None, dtype_bytes: int = 2) -> PrefillTiles:
    """The pinned tiles of the prefill kernel (the GPU autotunes over PREFILL_CONFIGS instead).

    Broadcast path (the interpreter: products of rows * block_n * block_d floats, at most 2^20, Triton's
    limit): the largest, since each program step costs milliseconds of interpretation there.
    Dot path (rows, block_n, block_d >= 16): 16 rows (at least one group) x 32 keys for fp16/bf16 up to
    head_dim 128, else x 16 keys (float32 tiles twice the bytes: 32 keys spill on sm_90 at head_dim 128,
    ``python -m kernels.compile_check``)."""
    use_dot = not interpret if use_dot is None else use_dot
    block_g = triton.next_power_of_2(group_size)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if not use_dot:
        block_m = min(triton.next_power_of_2(max(max_q_len, 1)), max(1, 128 // block_g))
        block_n = max(1, min(256, (1 << 20) // (block_m * block_g * block_d)))
        return PrefillTiles(block_m * block_g, block_g, block_n, block_d, 4, False)
    block_n = 32 if dtype_bytes == 2 and block_d <= 128 else 16
    return PrefillTiles(max(16, block_g), block_g, block_n, block_d, 4 if dtype_bytes == 2 else 8, True)


@functools.cache
def _prefill_autotuned():
    """``_prefill_kernel`` autotuned over PREFILL_CONFIGS (a GPU only: the interpreter runs the pinned
    :func:`prefill_tiles`), keyed by head dim, group and block size (and, implicitly, the dtypes)."""
    return triton.autotune(configs=PREFILL_CONFIGS, key=["head_dim", "group_size", "block_size"],
                           prune_configs_by={"early_config_prune": prune_prefill_configs})(_prefill_kernel)


@functools.cache
def parallelism() -> int:
    """Programs the device runs at once (streaming multiprocessors); 1 under the interpreter."""
    b = device.backend()
    if b.triton_interpret or not b.is_gpu:
        return 1
    return torch.cuda.get_device_properties(b.torch_device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split-K heuristic: split only when (seqs x kv heads) programs leave SMs idle, into as many splits
    as fill about two waves, each with at least MIN_KEYS_PER_SPLIT keys, at most MAX_SPLITS."""
    programs = max(num_seqs * num_kv_heads, 1)
    by_occupancy = math.ceil(2 * num_sms / programs)
    by_length = math.ceil(max_context / MIN_KEYS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How one decode call is launched: its tiles and its split count."""

    tiles: DecodeTiles
    num_splits: int  # programs per (sequence, kv head); 1..number of key tiles


def plan_decode(num_seqs: int, num_kv_heads: int, group_size: int, head_dim: int, max_context: int,
                num_splits: int | None, *, interpret: bool, num_sms: int, dtype_bytes: int = 2) -> DecodePlan:
    """Tiles, and the split count: the caller's ``num_splits`` if given, else :func:`choose_num_splits`;
    either is clamped to the key tiles of the longest possible context (``max_context`` keys), since a
    split past them has no key to visit and costs a partial buffer row and a reduction step."""
    use_dot = decode_uses_dot(group_size, interpret, dtype_bytes)
    tiles = decode_tiles(group_size, head_dim, max_context, interpret, use_dot)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, num_sms)
    return DecodePlan(tiles, max(1, min(num_splits, triton.cdiv(max_context, tiles.block_n))))


def _kv_scales(k_cache, scale, k_scale, v_scale, head_dim) -> tuple[float, float, bool]:
    """(scale of the scores with k_scale folded in, v_scale, whether the caches are fp8)."""
    fp8 = k_cache.dtype in FP8_DTYPES
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not fp8:
        return scale, 1.0, False
    return scale * (1.0 if k_scale is None else float(k_scale)), 1.0 if v_scale is None else float(v_scale), True


def _decode(q, k, v, block_tables, seq_lens, *, paged, block_size, scale, sliding_window, num_splits,
            out, max_context, k_scale=None, v_scale=None, plan: DecodePlan | None = None):
    """Shared launch of paged and contiguous decode; returns (out, lse). ``plan`` replaces
    :func:`plan_decode`'s choice (the tile sweep of ``bench.decode_sweep`` times candidates through it)."""
    _check_interpreter_mode()
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    scale, v_scale, fp8 = _kv_scales(k, scale, k_scale, v_scale, head_dim)
    if plan is None:
        plan = plan_decode(num_seqs, num_kv_heads, group, head_dim, max_context, num_splits,
                           interpret=device.backend().triton_interpret, num_sms=parallelism(),
                           dtype_bytes=q.element_size())
    num_splits, tiles = plan.num_splits, plan.tiles
    seq_lens = seq_lens.contiguous()  # the kernel reads seq_lens[s] at seq_lens_ptr + s
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty((num_seqs, num_heads), dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return out, lse
    if num_splits == 1:
        part_out, part_lse = out, lse
        out_strides = (*out.stride()[:2], 0, out.stride(2))
        lse_strides = (*lse.stride(), 0)
    else:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        out_strides, lse_strides = part_out.stride(), part_lse.stride()
    table = block_tables if paged else seq_lens  # unused pointer when not paged
    table_strides = block_tables.stride() if paged else (0, 0)
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k, v, table, seq_lens, part_out, part_lse,
        scale, v_scale, sliding_window or 0, block_size, group, head_dim, num_splits,
        *q.stride(), *k.stride(), *v.stride(), *table_strides, *out_strides, *lse_strides,
        PAGED=paged, USE_DOT=tiles.use_dot, BLOCK_SIZE=block_size_constexpr(block_size) if paged else 0,
        BLOCK_G=tiles.block_g, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d, KV_FP8=fp8,
        num_warps=tiles.num_warps,
        **({} if tiles.num_stages is None else {"num_stages": tiles.num_stages}),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, lse, num_splits, head_dim,
            *part_out.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
            BLOCK_SPLITS=triton.next_power_of_2(num_splits), BLOCK_D=tiles.block_d,
        )
    return out, lse


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, sliding_window=None,
                 num_splits=None, out=None, return_lse=False, validate=None, k_scale=None, v_scale=None,
                 batch_invariant=False):
    """Attention of one query per sequence (at its last position) over its paged K/V.

    q ``[num_seqs, num_heads, head_dim]`` float32/float16/bfloat16; k_cache, v_cache ``[num_blocks,
    block_size, num_kv_heads, head_dim]`` (q's dtype); block_tables int32 ``[num_seqs, max_blocks]``;
    seq_lens int32 ``[num_seqs]`` (any strides). ``num_splits`` forces split-K (None:
    :func:`choose_num_splits`), clamped to the number of key tiles (see :func:`plan_decode`).
    Returns out ``[num_seqs, num_heads, head_dim]`` (q's dtype; ``out`` itself when given) and, with
    ``return_lse``, lse float32 ``[num_seqs, num_heads]``.
    fp8 caches (``torch.float8_e4m3fn``, whatever q's dtype) hold ``k / k_scale`` and ``v / v_scale``
    (``write_kv``): keys read back as ``k_cache * k_scale``, values as ``v_cache * v_scale`` (None: 1.0).
    ``batch_invariant=True``: a sequence's rows are bit-identical whatever else is in the batch (one split
    per sequence, tiles chosen for :data:`INVARIANT_CONTEXT` rather than the batch's longest context); the
    price is split-K's parallelism for long contexts in small batches.
    """
    check_batch_invariant(batch_invariant, num_splits)
    shape = check_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                               sliding_window=sliding_window, num_splits=num_splits, out=out,
                               validate=validate, fp8=True, k_scale=k_scale, v_scale=v_scale)
    max_context = shape.max_blocks * shape.block_size
    plan = None
    if batch_invariant:
        plan = plan_decode(shape.num_seqs, shape.num_kv_heads, shape.group_size, shape.head_dim, INVARIANT_CONTEXT,
                           1, interpret=device.backend().triton_interpret, num_sms=parallelism(),
                           dtype_bytes=q.element_size())
    out, lse = _decode(q, k_cache, v_cache, block_tables, seq_lens, paged=True, block_size=shape.block_size,
                       scale=scale, sliding_window=sliding_window, num_splits=num_splits, out=out,
                       max_context=max_context, k_scale=k_scale, v_scale=v_scale, plan=plan)
    return (out, lse) if return_lse else out


def contiguous_decode(q, k, v, seq_lens, *, scale=None, out=None, validate=None):
    """The non-paged baseline: the decode kernel reading K/V rows ``k[s, :seq_lens[s]]`` directly.

    q ``[num_seqs, num_heads, head_dim]``; k, v ``[num_seqs, max_len, num_kv_heads, head_dim]``; seq_lens
    int32 ``[num_seqs]``. Same kernel, tiles and split heuristic as :func:`paged_decode`, so their time
    ratio measures the cost of the block-table indirection alone. Returns out like q. ``validate`` as
    :func:`paged_decode` (lengths in ``[0, max_len]``).
    """
    check_contiguous_decode(q, k, v, seq_lens, scale=scale, out=out, validate=validate)
    out, _ = _decode(q, k, v, None, seq_lens, paged=False, block_size=1, scale=scale, sliding_window=None,
                     num_splits=None, out=out, max_context=k.shape[1])
    return out


def paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale=None,
                  sliding_window=None, out=None, return_lse=False, validate=None, max_query_len=None,
                  k_scale=None, v_scale=None, batch_invariant=False):
    """Causal attention of each sequence's last ``q_len`` tokens over its paged K/V (already written).

    q ``[total_q_tokens, num_heads, head_dim]``; cu_seqlens_q int32 ``[num_seqs + 1]`` (sequence s owns
    rows ``cu_seqlens_q[s] : cu_seqlens_q[s+1]``); other arguments as :func:`paged_decode`. Returns out
    like q and, with ``return_lse``, lse float32 ``[total_q_tokens, num_heads]``. Reads cu_seqlens_q
    back to size the grid unless the caller gives ``max_query_len`` (the longest query, known on the
    host: no device sync). Rows owned by no sequence are left untouched. fp8 caches and their scales as
    :func:`paged_decode`. ``batch_invariant=True``: tiles independent of the batch's longest query (on a GPU
    the autotuner's choice already depends only on head dim, group and block size).
    """
    check_batch_invariant(batch_invariant)
    shape = check_paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale,
                                sliding_window=sliding_window, out=out, validate=validate, fp8=True,
                                k_scale=k_scale, v_scale=v_scale)
    _check_interpreter_mode()
    scale, v_scale, fp8 = _kv_scales(k_cache, scale, k_scale, v_scale, shape.head_dim)
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    # The kernel reads seq_lens[s] and cu_seqlens_q[s] at ptr + s: a strided view must be made dense.
    seq_lens, cu_seqlens_q = seq_lens.contiguous(), cu_seqlens_q.contiguous()
    if max_query_len is not None:  # known on the host: no device read
        max_q_len = int(max_query_len)
    else:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if shape.num_seqs else 0
    if max_q_len > 0:
        interpret = device.backend().triton_interpret
        use_dot = prefill_uses_dot(interpret)
        block_g = triton.next_power_of_2(shape.group_size)
        block_d = max(16, triton.next_power_of_2(shape.head_dim))
        args = (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, lse,
                scale, v_scale, sliding_window or 0, shape.block_size, shape.group_size, shape.head_dim,
                *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
                *lse.stride())
        fixed = {"USE_DOT": use_dot, "BLOCK_SIZE": block_size_constexpr(shape.block_size), "BLOCK_G": block_g,
                 "BLOCK_D": block_d, "KV_FP8": fp8}

        def grid(meta):
            return (triton.cdiv(max_q_len, meta["BLOCK_R"] // meta["BLOCK_G"]), shape.num_kv_heads,
                    shape.num_seqs)

        if use_dot and not interpret:
            _prefill_autotuned()[grid](*args, **fixed)
        else:
            q_len_for_tiles = INVARIANT_CONTEXT if batch_invariant else max_q_len
            tiles = prefill_tiles(shape.group_size, shape.head_dim, q_len_for_tiles, interpret, use_dot,
                                  q.element_size())
            _prefill_kernel[grid](*args, **fixed, BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n,
                                  num_warps=tiles.num_warps)
    return (out, lse) if return_lse else out
