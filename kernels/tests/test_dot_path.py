"""The GPU's ``tl.dot`` path of the attention kernels, run under the interpreter so its bugs fail here.

``prefill_uses_dot`` / ``decode_uses_dot`` are forced on, so the launchers pick the dot tiles (16+ rows,
16+ keys, native-dtype tiles, float32 accumulation) exactly as on a GPU; results are checked against
the float64 oracle with the suite's tolerance table, in float32 and float16 (the interpreter's bfloat16
``tl.dot`` is not trustworthy). Shapes are tiny but cross key tiles, blocks, a padded head_dim, the
specialised (16) and the generic (5) block size.

TF32 cannot be observed here (the interpreter multiplies float32 exactly whatever the precision asks),
so a static check pins that every ``tl.dot`` asks for ``ieee`` products.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from pagedbench import kernels
from pagedbench.conformance.gate import oracle
from pagedbench.conformance.gate.cases import TOLERANCES
from pagedbench.kernels import attention, attention_kernels

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
LAYOUTS = {"group1": (2, 2), "group4": (4, 1)}  # (num_heads, num_kv_heads)


@pytest.fixture
def dot_path(monkeypatch):
    monkeypatch.setattr(attention, "prefill_uses_dot", lambda interpret: True)
    monkeypatch.setattr(attention, "decode_uses_dot", lambda group_size, interpret, dtype_bytes=2: True)


def _inputs(dtype, block_size, layout, seed=0):
    """Two sequences (70 and 9 tokens) over a shuffled table, head_dim 24 (padded to 32)."""
    hq, hkv = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-70 // block_size)
    num_blocks = 2 * max_blocks
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).reshape(2, max_blocks)
    cache = (num_blocks, block_size, hkv, 24)
    return {
        "k_cache": torch.randn(cache, generator=gen).to(dtype),
        "v_cache": torch.randn(cache, generator=gen).to(dtype),
        "block_tables": table,
        "seq_lens": torch.tensor([70, 9], dtype=torch.int32),
        "q_decode": (torch.randn(2, hq, 24, generator=gen) * 2).to(dtype),
        "q_prefill": (torch.randn(20 + 9, hq, 24, generator=gen) * 2).to(dtype),
        "cu_seqlens_q": torch.tensor([0, 20, 29], dtype=torch.int32),
    }


def _check(out, ref, dtype):
    tol = TOLERANCES[dtype]
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    assert err.max() <= tol.max_abs and err.norm() / ref.norm() <= tol.rel, (float(err.max()),
                                                                             float(err.norm() / ref.norm()))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_dot_path_matches_oracle(dot_path, dtype, block_size, layout):
    x = _inputs(DTYPES[dtype], block_size, layout)
    args = (x["q_prefill"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["cu_seqlens_q"])
    tiles = attention.prefill_tiles(LAYOUTS[layout][0] // LAYOUTS[layout][1], 24, 20, True, True,
                                    DTYPES[dtype].itemsize)
    assert tiles.use_dot and tiles.block_r >= 16 and tiles.block_n < 70  # the keys span two tiles
    _check(kernels.paged_prefill(*args), oracle.prefill(*args).out, DTYPES[dtype])


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_dot_path_matches_oracle(dot_path, dtype, block_size, layout, num_splits):
    x = _inputs(DTYPES[dtype], block_size, layout)
    args = (x["q_decode"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"])
    hq, hkv = LAYOUTS[layout]
    plan = attention.plan_decode(2, hkv, hq // hkv, 24, x["block_tables"].shape[1] * block_size, num_splits,
                                 interpret=True, num_sms=1)
    assert plan.tiles.use_dot and plan.tiles.block_g == 16 and plan.num_splits == num_splits
    _check(kernels.paged_decode(*args, num_splits=num_splits), oracle.decode(*args).out, DTYPES[dtype])


def test_every_dot_asks_for_ieee_products():
    """float32 tiles must not use TF32 (10 mantissa bits miss the 1e-5 bound); the interpreter cannot
    show it, so the source is checked: one precision constant, "ieee", used by every tl.dot."""
    assert attention_kernels.DOT_PRECISION.value == "ieee"
    source = inspect.getsource(attention_kernels)
    assert not re.search(r"allow_tf32|[\"']tf32", source)
    dots = re.findall(r"tl\.dot\(([^\n]*)\)", source)
    assert len(dots) == 4 and all("input_precision=DOT_PRECISION" in d for d in dots), dots
