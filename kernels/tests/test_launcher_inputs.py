"""Our launchers' handling of awkward but legal inputs and of bad ones.

* index tensors given as strided views are read at their logical elements (the kernels index
  ``seq_lens`` and ``cu_seqlens_q`` densely, so the launchers make them dense first);
* index tensors in host memory are validated by default by every launcher, so an out-of-range slot,
  block id or length raises a ``ValueError`` naming it, before anything is written, instead of the
  interpreted kernel reading or writing outside the cache;
* ``num_splits`` is an integer >= 1, clamped to the key tiles (a huge value costs nothing);
* a wrong Python type raises a ``TypeError`` naming the argument.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from pagedbench import kernels
from pagedbench.kernels import attention, reference
from pagedbench.kernels.validation import KernelInputError

LAUNCHERS = {"triton": kernels, "torch": reference}
NB, BS, HKV, HQ, D = 6, 4, 2, 4, 16


def _paged(dtype=torch.float32, seed=0):
    """Two sequences (5 and 3 tokens) over a shuffled table; unused entries -1."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(2, HQ, D, generator=gen).to(dtype),
        "k_cache": torch.randn(NB, BS, HKV, D, generator=gen).to(dtype),
        "v_cache": torch.randn(NB, BS, HKV, D, generator=gen).to(dtype),
        "block_tables": torch.tensor([[4, 0, -1], [5, 1, -1]], dtype=torch.int32),
        "seq_lens": torch.tensor([5, 7], dtype=torch.int32),
    }


def _decode(fn, x, **kw):
    return fn(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], **kw)


# --- strided index tensors -----------------------------------------------------------------------

def test_decode_reads_strided_seq_lens_at_their_logical_elements():
    x = _paged()
    # every other element is a different, in-range length: reading them changes the answer
    interleaved = torch.tensor([5, 2, 7, 1], dtype=torch.int32)
    strided = interleaved[::2]
    assert not strided.is_contiguous()
    want = _decode(kernels.paged_decode, {**x, "seq_lens": strided.contiguous()})
    got = _decode(kernels.paged_decode, {**x, "seq_lens": strided})
    assert torch.equal(got, want)
    assert not torch.equal(want, _decode(kernels.paged_decode, {**x, "seq_lens": interleaved[:2]}))


def test_prefill_reads_strided_seq_lens_and_query_starts():
    x = _paged()
    q = torch.randn(6, HQ, D, generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([5, 2, 7, 3], dtype=torch.int32)[::2]
    cu = torch.tensor([0, 1, 2, 3, 6, 0], dtype=torch.int32)[::2]  # [0, 2, 6]; neighbours differ
    want = kernels.paged_prefill(q, x["k_cache"], x["v_cache"], x["block_tables"], lens.contiguous(),
                                 cu.contiguous())
    got = kernels.paged_prefill(q, x["k_cache"], x["v_cache"], x["block_tables"], lens, cu)
    assert torch.equal(got, want)


def test_contiguous_decode_reads_strided_seq_lens():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, HQ, D, generator=gen), torch.randn(2, 8, HKV, D, generator=gen)
    v = torch.randn(2, 8, HKV, D, generator=gen)
    lens = torch.tensor([8, 1, 3, 2], dtype=torch.int32)[::2]
    want = kernels.contiguous_decode(q, k, v, lens.contiguous())
    assert torch.equal(kernels.contiguous_decode(q, k, v, lens), want)


# --- default validation of host-memory index tensors ------------------------------------------------

@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("PAGEDBENCH_VALIDATE", raising=False)


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("slot", [NB * BS, 10**9, -2])
def test_write_kv_rejects_an_out_of_range_slot_by_default(no_env, name, slot):
    x = _paged()
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    with pytest.raises(KernelInputError, match=rf"slot_mapping\[1\] must be -1 \(skip\) or a slot in "
                                               rf"\[0, {NB * BS}\); got {slot}"):
        LAUNCHERS[name].write_kv(torch.randn(2, HKV, D), torch.randn(2, HKV, D), k_cache, v_cache,
                                 torch.tensor([3, slot], dtype=torch.int32))
    assert torch.equal(k_cache, x["k_cache"]) and torch.equal(v_cache, x["v_cache"])


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("block", [NB, 10**9, -1])
def test_copy_blocks_rejects_an_out_of_range_block_by_default(no_env, name, block):
    x = _paged()
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    with pytest.raises(KernelInputError, match=rf"pairs\[1, 0\] must be a block id in \[0, {NB}\); "
                                               rf"got {block}"):
        LAUNCHERS[name].copy_blocks(k_cache, v_cache, torch.tensor([[0, 1], [block, 2]], dtype=torch.int32))
    assert torch.equal(k_cache, x["k_cache"]) and torch.equal(v_cache, x["v_cache"])


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("seq_len", [9, 10**9, -1])
def test_contiguous_decode_rejects_an_out_of_range_length_by_default(no_env, name, seq_len):
    k = torch.randn(2, 8, HKV, D)
    out = torch.full((2, HQ, D), math.nan)
    with pytest.raises(KernelInputError, match=rf"seq_lens\[1\] must be in \[0, 8\] \(k.shape\[1\]\); "
                                               rf"got {seq_len}"):
        LAUNCHERS[name].contiguous_decode(torch.randn(2, HQ, D), k, k.clone(),
                                          torch.tensor([3, seq_len], dtype=torch.int32), out=out)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_validate_false_skips_the_value_checks(no_env, name):
    """validate=False is honoured (the caller vouches for the indices): a repeated slot is written."""
    x = _paged()
    k = torch.randn(2, HKV, D)
    LAUNCHERS[name].write_kv(k, k.clone(), x["k_cache"], x["v_cache"], torch.tensor([3, 3]), validate=False)
    assert any(torch.equal(x["k_cache"][0, 3], k[i]) for i in range(2))


# --- num_splits -------------------------------------------------------------------------------------

def test_huge_num_splits_is_clamped_to_the_key_tiles():
    x = _paged()
    want = _decode(kernels.paged_decode, x, num_splits=1)
    start = time.perf_counter()
    got = _decode(kernels.paged_decode, x, num_splits=10**9)
    assert time.perf_counter() - start < 20  # it allocated 10^9 partial rows and ran for minutes
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plan = attention.plan_decode(2, HKV, HQ // HKV, D, 3 * BS, 10**9, interpret=True, num_sms=1)
    assert plan.num_splits == math.ceil(3 * BS / plan.tiles.block_n) == 1
    plan = attention.plan_decode(2, HKV, HQ // HKV, D, 4096, 10**9, interpret=False, num_sms=132)
    assert plan.num_splits == 4096 // plan.tiles.block_n > 1


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("value, error", [(True, TypeError), (2.0, TypeError), ("2", TypeError),
                                          (0, ValueError), (-3, ValueError)])
def test_num_splits_must_be_an_integer_at_least_one(name, value, error):
    with pytest.raises(error, match=rf"num_splits must be an integer >= 1 or None; got {value!r}"):
        _decode(LAUNCHERS[name].paged_decode, _paged(), num_splits=value)


# --- wrong Python types -----------------------------------------------------------------------------

def _calls(x):
    """(launcher name, argument names, arguments) of a valid call of each launcher."""
    q6 = torch.randn(6, HQ, D)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    k3 = torch.randn(2, HKV, D)
    contiguous_k = torch.randn(2, 8, HKV, D)
    paged = ("q", "k_cache", "v_cache", "block_tables", "seq_lens")
    return [
        ("paged_decode", paged, [x[n] for n in paged]),
        ("paged_prefill", (*paged, "cu_seqlens_q"), [q6, *[x[n] for n in paged[1:]], cu]),
        ("contiguous_decode", ("q", "k", "v", "seq_lens"), [x["q"], contiguous_k, contiguous_k.clone(),
                                                           torch.tensor([3, 8], dtype=torch.int32)]),
        ("write_kv", ("k", "v", "k_cache", "v_cache", "slot_mapping"),
         [k3, k3.clone(), x["k_cache"], x["v_cache"], torch.tensor([0, 5])]),
        ("copy_blocks", ("k_cache", "v_cache", "pairs"),
         [x["k_cache"], x["v_cache"], torch.tensor([[0, 1]])]),
    ]


def _type_cases():
    return [(op, i, arg) for op, names, _ in _calls(_paged()) for i, arg in enumerate(names)]


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("op, index, arg", _type_cases(), ids=[f"{c[0]}-{c[2]}" for c in _type_cases()])
def test_a_list_for_a_tensor_is_a_type_error_naming_it(name, op, index, arg):
    x = _paged()
    before = (x["k_cache"].clone(), x["v_cache"].clone())
    _, _, args = next(c for c in _calls(x) if c[0] == op)
    args[index] = args[index].tolist()
    with pytest.raises(TypeError, match=rf"^{arg} must be a torch.Tensor .*; got list$"):
        getattr(LAUNCHERS[name], op)(*args)
    assert torch.equal(x["k_cache"], before[0]) and torch.equal(x["v_cache"], before[1])


@pytest.mark.parametrize("name", list(LAUNCHERS))
@pytest.mark.parametrize("option, value", [("scale", "0.1"), ("sliding_window", 2.5), ("validate", "yes"),
                                           ("validate", 1)])
def test_options_of_the_wrong_type_are_type_errors(name, option, value):
    with pytest.raises(TypeError, match=rf"{option} must be .*; got {value!r}"):
        _decode(LAUNCHERS[name].paged_decode, _paged(), **{option: value})
