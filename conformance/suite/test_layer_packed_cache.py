"""A layer-packed cache: one tensor holds every layer's K and V, and each layer's caches are views into it
at the layer's offset, past 2^31 (and 2^32) elements for the last layer (vLLM's int32 overflow where one
tensor holds every layer: the layer index times the layer stride formed in 32 bits).

Layout (elements; ``N`` = one cache of NUM_BLOCKS blocks, ``S`` = LAYER_STRIDE = 2^30 + 2N, which fits
int32)::

    0      N      2N               10N                S ...   4S = 2^32 + 8N    4S + N   4S + 2N
    | K[0] | V[0] |  NaN  ........  | (untouched) ...  | ...   |  K[4]          |  V[4]  |

Only layers 0 and 4 (the first and the last) are used; the others are never touched (``torch.empty``:
untouched pages cost no memory). Layer 4's offset kept in 32 bits comes back to ``8N``, inside the NaN
region, so such an implementation reads NaN or writes where nothing may change, and fails the value
checks with an assertion (a signed int32 offset of layers 2 and 3 would be negative instead: a fault,
which is why they are not used). Each test records its resident-memory growth (``rss_growth_mib``).
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedbench.conformance.gate import checks, oracle, resident_memory
from pagedbench.conformance.gate.cases import TOLERANCES

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 5, 8, 16, 1, 64
CACHE_NUMEL = NUM_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
LAYER_STRIDE = 2**30 + 2 * CACHE_NUMEL
POISON = (2 * CACHE_NUMEL, 10 * CACHE_NUMEL)  # where layer 4's offset lands when kept in 32 bits
LAYERS = (0, NUM_LAYERS - 1)
DTYPE = torch.float16


@pytest.fixture(scope="module")
def packed(impl):
    """The one tensor of every layer ``[num_layers, 2, num_blocks, block_size, H, D]`` (a strided view over
    a flat, mostly untouched allocation); the NaN region filled."""
    size = (NUM_LAYERS - 1) * LAYER_STRIDE + 2 * CACHE_NUMEL
    assert (NUM_LAYERS - 1) * LAYER_STRIDE > 2**32 and LAYER_STRIDE < 2**31
    try:
        flat = torch.empty(size, dtype=DTYPE, device=impl.device)
    except RuntimeError as e:  # pragma: no cover - a machine without the address space
        pytest.skip(f"cannot reserve a {size * 2 / 2**30:.1f} GiB layer-packed cache: {e}")
    flat[POISON[0] : POISON[1]] = math.nan
    block = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return flat, flat.as_strided(shape, (LAYER_STRIDE, CACHE_NUMEL, block, NUM_KV_HEADS * HEAD_DIM, HEAD_DIM, 1))


def _layer(packed, layer: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s K and V caches (views into the packed tensor), both layers used here filled with
    fresh random values (so layer 0 is never what layer 4 should read)."""
    _, views = packed
    for used in LAYERS:
        views[used].copy_(torch.randn(views[used].shape, generator=gen).to(DTYPE))
    k_cache, v_cache = views[layer, 0], views[layer, 1]
    assert k_cache.is_contiguous() and k_cache.storage_offset() == layer * LAYER_STRIDE
    return k_cache, v_cache


def _others(packed, layer: int) -> dict[str, torch.Tensor]:
    """Copies of what a call on ``layer`` must leave alone: the other used layer and the NaN region."""
    flat, views = packed
    other = LAYERS[1] if layer == LAYERS[0] else LAYERS[0]
    return {f"layer {other}": views[other].clone(), "the NaN region": flat[POISON[0] : POISON[1]].clone()}


def _assert_others_unchanged(packed, layer: int, before: dict[str, torch.Tensor], context: str) -> None:
    after = _others(packed, layer)
    for what, t in before.items():
        checks.assert_bitwise_equal(after[what], t, what=what, context=context)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_attention_reads_its_layer(impl, packed, op, layer):
    """Decode and prefill over one layer's views equal the oracle over those views, the last layer's
    offset past 2^32 elements included, and touch no other layer."""
    gen = torch.Generator().manual_seed(61 + layer)
    k_cache, v_cache = _layer(packed, layer, gen)
    dev = k_cache.device
    tables = torch.tensor([[5, 0, 7, 2], [NUM_BLOCKS - 1, 3, 1, 6]], dtype=torch.int32)
    lens = torch.tensor([3 * BLOCK_SIZE + 5, 2 * BLOCK_SIZE + 1], dtype=torch.int32)
    q_lens = [1, 1] if op == "decode" else [BLOCK_SIZE + 3, 2]
    q = (torch.randn(sum(q_lens), 2, HEAD_DIM, generator=gen) * 4).to(DTYPE)  # peaky: every key matters
    before = _others(packed, layer)
    rss = resident_memory.rss_mib()
    out = torch.full_like(q, math.nan).to(dev)
    if op == "decode":
        ref = oracle.decode(q, k_cache, v_cache, tables, lens)
        got = impl.paged_decode(q.to(dev), k_cache, v_cache, tables.to(dev), lens.to(dev), out=out)
    else:
        cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
        ref = oracle.prefill(q, k_cache, v_cache, tables, lens, cu)
        got = impl.paged_prefill(q.to(dev), k_cache, v_cache, tables.to(dev), lens.to(dev), cu.to(dev), out=out)
    checks.record("rss_growth_mib", resident_memory.rss_mib() - rss)
    tol = TOLERANCES[DTYPE]
    context = f"{op}/layer-packed,layer={layer}"
    checks.check_tensor(got, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out", context=context)
    checks.check_tensor(out, ref.out, DTYPE, rel=tol.rel, max_abs=tol.max_abs, what="out=", context=context)
    _assert_others_unchanged(packed, layer, before, context)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("op", ["write_kv", "copy_blocks"])
def test_cache_writes_land_in_their_layer(impl, packed, op, layer):
    """write_kv and copy_blocks on one layer's views change exactly the slots (blocks) they name in that
    layer, the last layer's offset past 2^32 elements included; the other layer and the NaN region stay
    bit-for-bit as they were."""
    gen = torch.Generator().manual_seed(71 + layer)
    k_cache, v_cache = _layer(packed, layer, gen)
    dev = k_cache.device
    want_k, want_v = k_cache.clone(), v_cache.clone()
    before = _others(packed, layer)
    rss = resident_memory.rss_mib()
    if op == "write_kv":
        slots = [NUM_BLOCKS * BLOCK_SIZE - 1, 0, 3 * BLOCK_SIZE + 7, -1]
        k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(dev)
        v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE).to(dev)
        for t, s in enumerate(slots):
            if s >= 0:
                want_k[s // BLOCK_SIZE, s % BLOCK_SIZE], want_v[s // BLOCK_SIZE, s % BLOCK_SIZE] = k[t], v[t]
        impl.write_kv(k, v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device=dev))
    else:
        pairs = [(NUM_BLOCKS - 1, 1), (0, 4)]
        for src, dst in pairs:
            want_k[dst], want_v[dst] = want_k[src].clone(), want_v[src].clone()
        impl.copy_blocks(k_cache, v_cache, torch.tensor(pairs, dtype=torch.int64, device=dev))
    checks.record("rss_growth_mib", resident_memory.rss_mib() - rss)
    context = f"{op}/layer-packed,layer={layer}"
    checks.assert_bitwise_equal(k_cache, want_k, what="k_cache", context=context)
    checks.assert_bitwise_equal(v_cache, want_v, what="v_cache", context=context)
    _assert_others_unchanged(packed, layer, before, context)
