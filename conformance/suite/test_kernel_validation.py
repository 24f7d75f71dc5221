"""The launchers' argument checks: bad shapes, dtypes, devices and ``out=`` are rejected before anything
runs, with an error naming the argument, the expected and the actual value; ``validate=True`` (or
``PAGEDBENCH_VALIDATE=1``) also rejects out-of-range block ids, lengths, query starts, slots and pairs.

Checks every implementation must make run through the ``impl`` fixture (any ``ValueError`` /
``TypeError`` passes there, and nothing may have been written); the messages and the ``validate``
specifics are those of our launchers, checked on the Triton launchers and the torch references alike.
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedbench.conformance.gate.validation import rejected
from pagedbench.conformance.our_launchers import LAUNCHERS

NB, BS, HKV, HQ, D = 6, 4, 2, 4, 8


def _inputs(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A valid decode call: two sequences (5 and 3 tokens) over a shuffled table; spare entries -1."""
    gen = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(2, HQ, D, generator=gen).to(dtype),
        "k_cache": torch.randn(NB, BS, HKV, D, generator=gen).to(dtype),
        "v_cache": torch.randn(NB, BS, HKV, D, generator=gen).to(dtype),
        "block_tables": torch.tensor([[4, 0, -1], [5, -1, -1]], dtype=torch.int32),
        "seq_lens": torch.tensor([5, 3], dtype=torch.int32),
    }


def _prefill_inputs() -> dict[str, torch.Tensor]:
    x = _inputs()
    x["q"] = torch.randn(6, HQ, D)
    x["cu_seqlens_q"] = torch.tensor([0, 4, 6], dtype=torch.int32)
    return x


def _decode(fn, x: dict, **kw):
    return fn(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], **kw)


def _prefill(fn, x: dict, **kw):
    return fn(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["cu_seqlens_q"], **kw)


# --- checks every implementation must make: shape mismatches are rejected, nothing is written ----
# (any exception counts here: another implementation may raise its own kind; ours raise
# ValueError/TypeError with a message, checked below on our launchers)

SHAPE_BREAKS = {
    "q-head-dim": lambda x: {**x, "q": x["q"][..., :5]},
    "q-rank": lambda x: {**x, "q": x["q"][0]},
    "gqa-ratio": lambda x: {**x, "q": torch.randn(2, 3, D)},
    "q-num-seqs": lambda x: {**x, "q": x["q"][:1]},
    "table-num-seqs": lambda x: {**x, "block_tables": x["block_tables"][:1]},
    "v-cache-shape": lambda x: {**x, "v_cache": x["v_cache"][:, :, :1]},
}
DTYPE_BREAKS = {
    "cache-dtype": lambda x: {**x, "k_cache": x["k_cache"].half(), "v_cache": x["v_cache"].half()},
    "table-dtype": lambda x: {**x, "block_tables": x["block_tables"].float()},
    "seq-lens-dtype": lambda x: {**x, "seq_lens": x["seq_lens"].float()},
}
WRITE_SHAPE_BREAKS = {
    "k-heads": lambda k, v, s: (k[:, :1], v[:, :1], s),
    "v-shape": lambda k, v, s: (k, v[:2], s),
    "slots-length": lambda k, v, s: (k, v, s[:2]),
}
WRITE_DTYPE_BREAKS = {
    "slots-dtype": lambda k, v, s: (k, v, s.float()),
    "k-dtype": lambda k, v, s: (k.half(), v.half(), s),
}


def _write(fn, brk, raises):
    """Call write_kv with broken arguments (``brk`` maps valid k, v, slots to broken ones) inside the
    context ``raises`` (``rejected()`` or ``pytest.raises(...)``); the caches must be byte-identical
    after it raised (compared outside ``raises``, so the comparison cannot be taken for the rejection)."""
    x = _inputs()
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    k, v, slots = brk(torch.randn(3, HKV, D), torch.randn(3, HKV, D), torch.tensor([0, 5, 9]))
    with raises:
        fn(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, x["k_cache"]) and torch.equal(v_cache, x["v_cache"]), "cache was written"


@pytest.mark.parametrize("brk", list(SHAPE_BREAKS), ids=list(SHAPE_BREAKS))
def test_decode_rejects_mismatched_shapes(impl, brk):
    with rejected():
        _decode(impl.paged_decode, SHAPE_BREAKS[brk](_inputs()))


def test_decode_rejects_out_of_the_wrong_shape_and_leaves_it_untouched(impl):
    out = torch.full((2, HQ, D + 1), math.nan)
    with rejected():
        _decode(impl.paged_decode, _inputs(), out=out)
    assert torch.isnan(out).all()


def test_prefill_rejects_wrong_cu_seqlens_length(impl):
    x = _prefill_inputs()
    x["cu_seqlens_q"] = x["cu_seqlens_q"][:2]
    with rejected():
        _prefill(impl.paged_prefill, x)


def test_contiguous_decode_rejects_mismatched_kv(impl):
    q, k = torch.randn(2, HQ, D), torch.randn(2, 7, HKV, D)
    with rejected():
        impl.contiguous_decode(q, k, k[:, :5], torch.tensor([3, 5], dtype=torch.int32))


@pytest.mark.parametrize("brk", list(WRITE_SHAPE_BREAKS), ids=list(WRITE_SHAPE_BREAKS))
def test_write_kv_rejects_mismatched_shapes_and_writes_nothing(impl, brk):
    _write(impl.write_kv, WRITE_SHAPE_BREAKS[brk], rejected())


@pytest.mark.parametrize("pairs", [torch.tensor([[0, 1, 2]]), torch.tensor([0, 1])],
                         ids=["3-columns", "rank-1"])
def test_copy_blocks_rejects_bad_pairs_and_copies_nothing(impl, pairs):
    x = _inputs()
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    with rejected():
        impl.copy_blocks(k_cache, v_cache, pairs)
    assert torch.equal(k_cache, x["k_cache"]) and torch.equal(v_cache, x["v_cache"])


# --- our launchers: ValueError / TypeError before anything runs, dtypes too -------------------------

@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("brk", list(SHAPE_BREAKS) + list(DTYPE_BREAKS))
def test_our_decode_raises_value_or_type_errors(name, brk):
    x = {**SHAPE_BREAKS, **DTYPE_BREAKS}[brk](_inputs())
    error = TypeError if brk in DTYPE_BREAKS else ValueError
    with pytest.raises(error):
        _decode(LAUNCHERS[name].paged_decode, x)


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("brk", list(WRITE_SHAPE_BREAKS) + list(WRITE_DTYPE_BREAKS))
def test_our_write_kv_raises_value_or_type_errors_and_writes_nothing(name, brk):
    error = TypeError if brk in WRITE_DTYPE_BREAKS else ValueError
    _write(LAUNCHERS[name].write_kv, {**WRITE_SHAPE_BREAKS, **WRITE_DTYPE_BREAKS}[brk], pytest.raises(error))


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_our_copy_blocks_rejects_float_pairs(name):
    x = _inputs()
    with pytest.raises(TypeError, match=r"pairs must have dtype int32 or int64; got torch.float32"):
        LAUNCHERS[name].copy_blocks(x["k_cache"], x["v_cache"], torch.tensor([[0.0, 1.0]]))


# --- our messages: argument, expected, actual ----------------------------------------------------

MESSAGES = [
    ("q-head-dim", r"q: head_dim \(q.shape\[2\]\) = k_cache.shape\[3\] must be 8; got 5"),
    ("q-rank", r"q must be 3-D \[num_seqs, num_heads, head_dim\]; got shape \(4, 8\)"),
    ("gqa-ratio", r"num_heads .* multiple of num_kv_heads \(k_cache.shape\[2\] = 2\); got 3"),
    ("table-num-seqs", r"block_tables: num_seqs .* must be 2; got 1"),
    ("v-cache-shape", r"v_cache must have the shape of k_cache \(6, 4, 2, 8\); got \(6, 4, 1, 8\)"),
    ("cache-dtype", r"k_cache must have the dtype of q \(torch.float32\); got torch.float16"),
    ("table-dtype", r"block_tables must have dtype int32; got torch.float32"),
]


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("brk, message", MESSAGES, ids=[m[0] for m in MESSAGES])
def test_decode_error_names_expected_and_actual(name, brk, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _decode(LAUNCHERS[name].paged_decode, {**SHAPE_BREAKS, **DTYPE_BREAKS}[brk](_inputs()))


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_out_errors_name_expected_and_actual(name):
    x = _inputs()
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4, 8\); got \(2, 4, 9\)"):
        _decode(LAUNCHERS[name].paged_decode, x, out=torch.empty(2, HQ, D + 1))
    with pytest.raises(TypeError, match=r"out must have dtype torch.float32 .*; got torch.float16"):
        _decode(LAUNCHERS[name].paged_decode, x, out=torch.empty(2, HQ, D, dtype=torch.float16))


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("arg", ["block_tables", "seq_lens", "k_cache"])
def test_device_mismatch_is_rejected(name, arg):
    x = _inputs()
    x[arg] = x[arg].to("meta")
    if arg == "k_cache":
        x["v_cache"] = x["v_cache"].to("meta")
    with pytest.raises(ValueError, match=rf"{arg} must be on cpu \(the device of q\); got meta"):
        _decode(LAUNCHERS[name].paged_decode, x)


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("option, value", [("scale", math.inf), ("sliding_window", 0), ("num_splits", 0),
                                           ("num_splits", 1.5)])
def test_bad_options_are_rejected(name, option, value):
    with pytest.raises(ValueError, match=rf"{option} must be .*; got {value!r}"):
        _decode(LAUNCHERS[name].paged_decode, _inputs(), **{option: value})


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_kernel_dtypes_only_for_triton(name):
    x = _inputs(torch.float64)
    if name == "torch":  # the reference also computes in float64
        assert _decode(LAUNCHERS[name].paged_decode, x).dtype == torch.float64
    else:
        message = r"q must have dtype float32 or float16 or bfloat16; got torch.float64"
        with pytest.raises(TypeError, match=message):
            _decode(LAUNCHERS[name].paged_decode, x)


# --- validate=True / PAGEDBENCH_VALIDATE=1 ------------------------------------------------------

@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("bad_id", [NB, -1, 10**6])
def test_validate_rejects_out_of_range_block_id_in_use(name, bad_id):
    x = _inputs()
    x["block_tables"][0, 1] = bad_id  # sequence 0 (5 tokens, block size 4) uses entries 0 and 1
    out = torch.full_like(x["q"], math.nan)
    with pytest.raises(ValueError, match=rf"block_tables\[0, 1\] must be a block id in \[0, {NB}\) "
                                         rf"\(sequence 0 uses it: seq_len 5\); got {bad_id}"):
        _decode(LAUNCHERS[name].paged_decode, x, validate=True, out=out)
    assert torch.isnan(out).all()  # nothing launched


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_validate_ignores_table_entries_past_the_length(name):
    x = _inputs()
    x["block_tables"][1, 1:] = 10**6  # sequence 1 (3 tokens) uses only entry 0
    out = _decode(LAUNCHERS[name].paged_decode, x, validate=True)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("seq_len", [13, -1])
def test_validate_rejects_lengths_beyond_the_table(name, seq_len):
    x = _inputs()
    x["seq_lens"][1] = seq_len
    with pytest.raises(ValueError, match=rf"seq_lens\[1\] must be in \[0, 12\] .*; got {seq_len}"):
        _decode(LAUNCHERS[name].paged_decode, x, validate=True)


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_host_memory_tables_are_validated_by_default(name, monkeypatch):
    """Index tensors in host memory cost no device sync to check, and an unchecked out-of-range length
    makes the interpreted kernel read outside the cache (a crash): validate=None checks them there."""
    monkeypatch.delenv("PAGEDBENCH_VALIDATE", raising=False)
    x = _inputs()
    if x["block_tables"].device.type != "cpu":
        pytest.skip("index tensors are on a GPU: validate=None does not check them (no device sync)")
    x["seq_lens"][1] = 13
    with pytest.raises(ValueError, match=r"seq_lens\[1\] must be in \[0, 12\] .*; got 13"):
        _decode(LAUNCHERS[name].paged_decode, x)


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_validation_env_var_and_override(name, monkeypatch):
    x = _prefill_inputs()
    x["cu_seqlens_q"] = torch.tensor([0, 1, 6], dtype=torch.int32)  # 5 queries, 3 cached tokens
    monkeypatch.setenv("PAGEDBENCH_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"sequence 1: query length"):
        _prefill(LAUNCHERS[name].paged_prefill, x)
    # validate=False wins over the variable; unvalidated, queries before position 0 see no key.
    out, lse = _prefill(LAUNCHERS[name].paged_prefill, x, validate=False, return_lse=True)
    assert torch.equal(out[1:3], torch.zeros_like(out[1:3]))
    assert torch.equal(lse[1:3], torch.full_like(lse[1:3], -math.inf))
    assert torch.isfinite(out).all() and torch.isfinite(lse[3:]).all()


PREFILL_BAD_STARTS = [
    ([0, 4, 7], r"cu_seqlens_q\[-1\] must equal total_q_tokens \(q.shape\[0\] = 6\); got 7"),
    ([1, 4, 6], r"cu_seqlens_q\[0\] must be 0; got 1"),
    ([0, 5, 4], r"cu_seqlens_q must be non-decreasing; got cu_seqlens_q\[1\] = 5 > cu_seqlens_q\[2\] = 4"),
    ([0, 1, 6], r"sequence 1: query length .* must be <= seq_lens\[1\] = 3 .*; got 5"),
]


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("cu, message", PREFILL_BAD_STARTS, ids=["end", "start", "order", "too-long"])
def test_validate_rejects_bad_query_starts(name, cu, message):
    x = _prefill_inputs()
    x["cu_seqlens_q"] = torch.tensor(cu, dtype=torch.int32)
    out = torch.full_like(x["q"], math.nan)
    with pytest.raises(ValueError, match=message):
        _prefill(LAUNCHERS[name].paged_prefill, x, validate=True, out=out)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("slots, message", [
    ([0, NB * BS, 1], rf"slot_mapping\[1\] must be -1 \(skip\) or a slot in \[0, {NB * BS}\); got {NB * BS}"),
    ([0, -2, 1], r"slot_mapping\[1\] must be -1 \(skip\) or a slot in .*; got -2"),
    ([3, -1, 3], r"slot_mapping must not repeat a slot"),
], ids=["past-end", "negative", "repeated"])
def test_validated_write_kv_rejects_bad_slots_and_writes_nothing(name, slots, message, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_VALIDATE", "1")
    x = _inputs()
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    with pytest.raises(ValueError, match=message):
        LAUNCHERS[name].write_kv(torch.randn(3, HKV, D), torch.randn(3, HKV, D), k_cache, v_cache,
                                 torch.tensor(slots))
    assert torch.equal(k_cache, x["k_cache"]) and torch.equal(v_cache, x["v_cache"])


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("pairs, message", [
    ([[0, 1], [2, NB]], rf"pairs\[1, 1\] must be a block id in \[0, {NB}\); got {NB}"),
    ([[0, 1], [2, 1]], r"destination blocks must be distinct"),
    ([[0, 1], [1, 2]], r"a destination block must not also be a source"),
], ids=["range", "duplicate-dst", "chain"])
def test_validated_copy_blocks_rejects_bad_pairs_and_copies_nothing(name, pairs, message, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_VALIDATE", "1")
    x = _inputs()
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    with pytest.raises(ValueError, match=message):
        LAUNCHERS[name].copy_blocks(k_cache, v_cache, torch.tensor(pairs))
    assert torch.equal(k_cache, x["k_cache"]) and torch.equal(v_cache, x["v_cache"])


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_validated_contiguous_decode_rejects_lengths_past_max_len(name, monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_VALIDATE", "1")
    k = torch.randn(2, 7, HKV, D)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] must be in \[0, 7\] \(k.shape\[1\]\); got 8"):
        LAUNCHERS[name].contiguous_decode(torch.randn(2, HQ, D), k, k.clone(),
                                          torch.tensor([8, 2], dtype=torch.int32))
