"""fp8 caches' arguments: scales only with fp8 caches, finite and > 0 (the engine's batched torch backend's
launchers too); every launcher that does not read fp8 caches rejects them by dtype, naming it."""

from __future__ import annotations

import re

import pytest
import torch
from pagedbench import kernels
from pagedbench.kernels import reference
from pagedbench.kernels.validation import KernelDtypeError, KernelInputError, KernelTypeError

FP8 = torch.float8_e4m3fn


def _batched():
    from pagedbench.refengine.model import batched_attention  # the engine's: imported only when tested

    return batched_attention


IMPLS = {"triton": lambda: kernels, "torch": lambda: reference, "torch-batched": _batched}


def _decode_args(cache_dtype=FP8):
    cache = torch.zeros(3, 4, 1, 8).to(cache_dtype)
    return (torch.randn(1, 2, 8), cache, cache.clone(), torch.tensor([[2, 0]], dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32))


@pytest.mark.parametrize("which", sorted(IMPLS))
@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"k_scale": 0.0}, KernelInputError, "k_scale must be a finite number > 0 or None; got 0.0"),
    ({"v_scale": float("nan")}, KernelInputError, "v_scale must be a finite number > 0 or None; got nan"),
    ({"k_scale": "1"}, KernelTypeError, "k_scale must be a finite number > 0 or None; got '1'"),
])
def test_bad_scales_raise(which, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        IMPLS[which]().paged_decode(*_decode_args(), **kwargs)


@pytest.mark.parametrize("which", sorted(IMPLS))
def test_scales_on_a_non_fp8_cache_raise(which):
    with pytest.raises(KernelInputError, match=re.escape("k_scale applies to fp8 caches only")):
        IMPLS[which]().paged_decode(*_decode_args(torch.float32), k_scale=0.5)
    k = torch.randn(2, 1, 8)
    cache = torch.zeros(3, 4, 1, 8)
    with pytest.raises(KernelInputError, match=re.escape("v_scale applies to fp8 caches only")):
        IMPLS[which]().write_kv(k, k, cache, cache.clone(), torch.tensor([0, 1]), v_scale=2.0)
    assert not cache.any()


def test_fp8_caches_elsewhere_are_rejected_by_dtype():
    q = torch.randn(1, 2, 8)
    kv = torch.zeros(1, 4, 1, 8).to(FP8)
    with pytest.raises(KernelDtypeError, match="k must have dtype"):
        kernels.contiguous_decode(q, kv, kv.clone(), torch.tensor([3], dtype=torch.int32))
