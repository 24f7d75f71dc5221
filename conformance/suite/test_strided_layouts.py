"""Views with unusual strides: q, ``out=``, the caches, the block tables and the tokens written, each laid
out as engines hand them over (a slice of a fused QKV projection, heads outermost, K and V interleaved in
one tensor, blocks stored head-major or padded, every other element of a wider buffer), one at a time and
all together; and the same call repeated across a stride change, which an implementation with a plan/run
split must not serve from a plan made for the old strides (FlashInfer's plan cache was keyed without them).

An implementation may refuse a layout, but only clearly: ``NotSupported``, or a ``ValueError`` /
``TypeError`` whose message names the layout ("contiguous", "stride", "layout"); the case is then "not
supported", and a refused ``write_kv`` must have left the caches as they were. Any other exception, a
wrong value, or a write outside the view (the elements around every view are NaN and must stay NaN)
fails.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from pagedbench.conformance import capabilities
from pagedbench.conformance.gate import builders, checks
from pagedbench.conformance.gate.cases import AttentionCase
from pagedbench.conformance.gate.refusal import call_or_refused


def restride(t: torch.Tensor, order: tuple[int, ...], pad: tuple[int, int] | None = None,
             fill: float = math.nan) -> torch.Tensor:
    """``t``'s values in a view whose dims are stored outermost-first in ``order`` (a permutation of
    ``t``'s dims), with ``pad = (dim, extra)`` unused elements after each run of ``dim`` (filled with
    ``fill``): e.g. order (1, 0, 2) stores a ``[tokens, heads, dim]`` tensor heads-major."""
    phys = [t.shape[i] for i in order]
    if pad is not None:
        phys[order.index(pad[0])] += pad[1]
    buf = torch.full(phys, fill, dtype=t.dtype, device=t.device)
    view = buf.permute([order.index(i) for i in range(t.dim())])
    if pad is not None:
        view = view.narrow(pad[0], 0, t.shape[pad[0]])
    view.copy_(t)
    return view


def every_other(t: torch.Tensor, fill: float = math.nan) -> torch.Tensor:
    """``t``'s values at every other element of a buffer twice as long in its last dim (last stride 2)."""
    buf = torch.full((*t.shape, 2), fill, dtype=t.dtype, device=t.device)
    view = buf[..., 0]
    view.copy_(t)
    return view


def interleaved(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches as the two halves of one ``[num_blocks, 2, block_size, H, D]`` tensor."""
    both = torch.stack([k, v], dim=1)
    return both[:, 0], both[:, 1]


def column_slice(t: torch.Tensor) -> torch.Tensor:
    """An int tensor in a column slice of a wider one whose other columns hold -7 (never a block id)."""
    buf = torch.full((*t.shape[:-1], t.shape[-1] + 3), -7, dtype=t.dtype, device=t.device)
    view = buf[..., 1 : 1 + t.shape[-1]]
    view.copy_(t)
    return view


#: layout name -> how it changes the inputs (a PagedInputs -> PagedInputs)
INPUT_LAYOUTS = {
    "q-fused-qkv": lambda x: replace(x, q=restride(x.q, (0, 1, 2), pad=(1, 6))),  # q's heads, then k's and v's
    "q-heads-outermost": lambda x: replace(x, q=restride(x.q, (1, 0, 2))),
    "q-dim-stride-2": lambda x: replace(x, q=every_other(x.q)),
    "kv-interleaved": lambda x: replace(x, **dict(zip(("k_cache", "v_cache"), interleaved(x.k_cache, x.v_cache)))),
    "kv-head-major-blocks": lambda x: replace(x, k_cache=restride(x.k_cache, (0, 2, 1, 3)),
                                              v_cache=restride(x.v_cache, (0, 2, 1, 3))),
    "kv-padded-blocks": lambda x: replace(x, k_cache=restride(x.k_cache, (0, 1, 2, 3), pad=(1, 3)),
                                          v_cache=restride(x.v_cache, (0, 1, 2, 3), pad=(1, 3))),
    "tables-column-slice": lambda x: replace(x, block_tables=column_slice(x.block_tables),
                                             seq_lens=x.seq_lens.repeat_interleave(2)[::2]),
}
#: layout name -> how it lays out the NaN-filled out= buffer
OUT_LAYOUTS = {
    "out-heads-outermost": lambda out: restride(out, (1, 0, 2)),
    "out-padded-rows": lambda out: restride(out, (0, 1, 2), pad=(2, 5)),
}
CONTIGUOUS = "contiguous"
#: several at once: q from a fused projection, head-major blocks, a sliced table, out heads-outermost and padded
ALL = "all-at-once"
ALL_INPUTS = ("q-fused-qkv", "kv-head-major-blocks", "tables-column-slice")

DECODE = AttentionCase("decode", block_size=8, seq_lens=(21, 3, 40), num_heads=4, num_kv_heads=2, head_dim=32,
                       dtype="fp32", query="peaky")
PREFILL = AttentionCase("prefill", block_size=8, seq_lens=(21, 3, 40), q_lens=(21, 2, 9), num_heads=4,
                        num_kv_heads=2, head_dim=32, dtype="fp32", query="peaky")
LAYOUTS = [*INPUT_LAYOUTS, *OUT_LAYOUTS, ALL]
CASES = [(case, layout) for case in (DECODE, PREFILL) for layout in LAYOUTS]
CASES.append((replace(DECODE, num_splits=2), ALL))  # the split-K partials and their reduction, strided out


def relayout(x: builders.PagedInputs, layout: str) -> tuple[builders.PagedInputs, torch.Tensor]:
    """(inputs, NaN-filled ``out=`` buffer) in ``layout``, with the values of ``x``."""
    out = builders.nan_out(x.q.shape[0], x.q)
    if layout == ALL:
        for name in ALL_INPUTS:
            x = INPUT_LAYOUTS[name](x)
        return x, restride(out, (1, 0, 2), pad=(2, 5))
    if layout in INPUT_LAYOUTS:
        return INPUT_LAYOUTS[layout](x), out
    if layout in OUT_LAYOUTS:
        return x, OUT_LAYOUTS[layout](out)
    assert layout == CONTIGUOUS, layout
    return x, out


def storage_of(t: torch.Tensor) -> torch.Tensor:
    """Every element of the storage under the view ``t``, as a flat view."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


def same_view(t: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The view ``t`` makes of its storage, made of ``whole`` (a flat tensor as long as that storage)."""
    return whole.as_strided(t.shape, t.stride(), t.storage_offset())


def assert_nothing_written_around(t: torch.Tensor, *, what: str, context: str) -> None:
    """Every element of ``t``'s storage outside the view still NaN."""
    outside = torch.ones(storage_of(t).shape, dtype=torch.bool, device=t.device)
    same_view(t, outside).fill_(False)
    around = storage_of(t)[outside]
    if not bool(around.isnan().all()):
        raise AssertionError(f"{context}: {what}: {int((~around.isnan()).sum())} elements outside the view "
                             "were written")


def run_layout(impl, case: AttentionCase, x: builders.PagedInputs, layout: str, ref) -> None:
    """One call with the inputs and ``out=`` in ``layout``, judged against ``ref``."""
    y, out = relayout(x, layout)
    context = f"{case.id},{layout}"
    result = call_or_refused(context, lambda: builders.call(impl, case, y, out=out))
    got, _ = checks.split_result(result, False)
    checks.check_tensor(got, ref.out, case.torch_dtype, rel=case.tolerance.rel, max_abs=case.tolerance.max_abs,
                        what="out", context=context)
    checks.check_case_tensor(out, ref.out, case, what="out_buffer")
    assert_nothing_written_around(out, what="out_buffer", context=context)


@pytest.mark.parametrize("case,layout", CASES, ids=[f"{c.id},{layout}" for c, layout in CASES])
def test_strided_views_match_the_oracle(impl, case, layout):
    """The case with one tensor (or every tensor) in an unusual layout equals the oracle, and nothing
    outside the ``out=`` view is written."""
    capabilities.require(impl, case)
    x = builders.build(case, impl.device)
    run_layout(impl, case, x, layout, builders.expected(case, x))


#: one call after another with the same shapes and metadata, the strides changing in between
STRIDE_CHANGES = (CONTIGUOUS, "q-fused-qkv", "kv-head-major-blocks", "out-heads-outermost", ALL, CONTIGUOUS)


@pytest.mark.parametrize("case", [DECODE, PREFILL], ids=lambda c: c.op)
def test_a_stride_change_between_calls_is_seen(impl, case):
    """The same batch (shapes, tables, lengths) run again and again while the layouts of q, the caches and
    ``out=`` change: each call equals the oracle (a plan made for the first call's strides and reused for
    the next ones would read the wrong elements)."""
    capabilities.require(impl, case)
    x = builders.build(case, impl.device)
    ref = builders.expected(case, x)
    for layout in STRIDE_CHANGES:
        run_layout(impl, case, x, layout, ref)


NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 4, 2, 16
#: layout name -> (k and v tokens, k_cache and v_cache, slot_mapping) -> the same values laid out anew
WRITE_LAYOUTS = {
    "tokens-fused-qkv": lambda k, v, kc, vc, slots: (restride(k, (0, 1, 2), pad=(1, 5)),
                                                     restride(v, (0, 1, 2), pad=(1, 5)), kc, vc, slots),
    "tokens-dim-stride-2": lambda k, v, kc, vc, slots: (every_other(k), every_other(v), kc, vc, slots),
    "kv-interleaved": lambda k, v, kc, vc, slots: (k, v, *interleaved(kc, vc), slots),
    "kv-head-major-blocks": lambda k, v, kc, vc, slots: (k, v, restride(kc, (0, 2, 1, 3)),
                                                         restride(vc, (0, 2, 1, 3)), slots),
    "kv-padded-blocks": lambda k, v, kc, vc, slots: (k, v, restride(kc, (0, 1, 2, 3), pad=(1, 3)),
                                                     restride(vc, (0, 1, 2, 3), pad=(1, 3)), slots),
    "slots-every-other": lambda k, v, kc, vc, slots: (k, v, kc, vc, slots.repeat_interleave(2)[::2]),
}


@pytest.mark.parametrize("layout", list(WRITE_LAYOUTS))
def test_write_kv_into_strided_views(impl, layout):
    """write_kv with its tokens, caches or slot mapping in an unusual layout: each written slot holds its
    token, every other element of the caches' storage (the other slots, the padding, the other half of an
    interleaved tensor) is bit-for-bit as before; a refusal leaves the storage as it was."""
    gen = torch.Generator().manual_seed(71)
    dev = impl.device
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dev) for _ in range(2))
    k, v = (torch.randn(7, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dev) for _ in range(2))
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:7]
    slots[2] = -1  # the padding slot: skipped
    k, v, k_cache, v_cache, slots = WRITE_LAYOUTS[layout](k, v, k_cache, v_cache, slots.to(dev))
    storages = [storage_of(c) for c in (k_cache, v_cache)]
    before = [s.clone() for s in storages]
    want = [s.clone() for s in storages]
    want_k, want_v = same_view(k_cache, want[0]), same_view(v_cache, want[1])
    if k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr():  # one interleaved tensor
        want_v = same_view(v_cache, want[0])
        want[1] = want[0]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // BLOCK_SIZE, s % BLOCK_SIZE], want_v[s // BLOCK_SIZE, s % BLOCK_SIZE] = k[t], v[t]
    context = f"write_kv/{layout}"
    try:
        call_or_refused(context, lambda: impl.write_kv(k, v, k_cache, v_cache, slots))
    except pytest.skip.Exception:
        for s, b in zip(storages, before):
            checks.assert_bitwise_equal(s, b, what="the caches' storage after a refusal", context=context)
        raise
    for s, w, name in zip(storages, want, ("k_cache", "v_cache")):
        checks.assert_bitwise_equal(s, w, what=f"{name}'s storage", context=context)


#: layouts copy_blocks is given: the write layouts' cache ones, and strided pairs
COPY_LAYOUTS = ("kv-interleaved", "kv-head-major-blocks", "kv-padded-blocks", "pairs-every-other-row")


@pytest.mark.parametrize("layout", COPY_LAYOUTS)
def test_copy_blocks_between_strided_blocks(impl, layout):
    """copy_blocks on caches in an unusual layout: each destination block becomes its source, every other
    element of the caches' storage is bit-for-bit as before; a refusal leaves the storage as it was."""
    gen = torch.Generator().manual_seed(72)
    dev = impl.device
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dev) for _ in range(2))
    none = torch.empty(0, NUM_KV_HEADS, HEAD_DIM, device=dev)
    pairs = torch.tensor([[NUM_BLOCKS - 1, 0], [2, 4]], dtype=torch.int64, device=dev)
    if layout in WRITE_LAYOUTS:
        _, _, k_cache, v_cache, _ = WRITE_LAYOUTS[layout](none, none, k_cache, v_cache, None)
    else:  # each pair on every other row of a wider tensor (row stride 4)
        pairs = pairs.repeat_interleave(2, dim=0)[::2]
    storages = [storage_of(c) for c in (k_cache, v_cache)]
    before = [s.clone() for s in storages]
    want = [s.clone() for s in storages]
    if k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr():  # one interleaved tensor
        want[1] = want[0]
    want_k, want_v = same_view(k_cache, want[0]), same_view(v_cache, want[1])
    for src, dst in pairs.tolist():
        want_k[dst], want_v[dst] = want_k[src].clone(), want_v[src].clone()
    context = f"copy_blocks/{layout}"
    try:
        call_or_refused(context, lambda: impl.copy_blocks(k_cache, v_cache, pairs))
    except pytest.skip.Exception:
        for s, b in zip(storages, before):
            checks.assert_bitwise_equal(s, b, what="the caches' storage after a refusal", context=context)
        raise
    for s, w, name in zip(storages, want, ("k_cache", "v_cache")):
        checks.assert_bitwise_equal(s, w, what=f"{name}'s storage", context=context)
