"""fp8 KV caches (float8_e4m3fn with per-tensor ``k_scale`` / ``v_scale``, vLLM's names), for
implementations that declare ``Capabilities(fp8_kv_cache=True)``; the others report "not supported".

The contract: ``write_kv`` stores ``round(k / k_scale)`` (to nearest, saturated at +-448), and attention
reads ``stored * k_scale`` (``* v_scale`` for values). Writes are judged by the format's own bound
(``cases.FP8_E4M3``); attention over an fp8 cache against the float64 oracle over the dequantized cache,
with q's dtype's tolerance. K and V scales always differ, values reach the format's maximum, and a prefix
written in one step is read in later ones (a scale forgotten on the cached-prefix read gives a right first
reply and wrong follow-ups).
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedbench.conformance.gate import builders, checks, oracle
from pagedbench.conformance.gate.cases import DTYPES, FP8_E4M3, AttentionCase

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.0125, 0.004  # stored magnitudes ~80 (K) and ~250 (V): the top of the format
NAN_BYTE = 0x7F  # float8_e4m3fn NaN


def _require_fp8(impl, dtype: torch.dtype | None = None) -> None:
    if not impl.capabilities.fp8_kv_cache:
        pytest.skip(f"not supported: {impl.name} does not declare fp8_kv_cache")
    if dtype is not None and (dtype not in impl.dtypes or dtype not in impl.capabilities.dtypes):
        pytest.skip(f"not supported: {impl.name} does not claim {dtype}")


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in float64, saturated at the format's maximum, rounded to nearest fp8 (NaN stays NaN)."""
    return (x.to(torch.float64) / scale).clamp(-FP8_E4M3.max_value, FP8_E4M3.max_value).to(FP8)


def dequantize(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return cache.cpu().to(torch.float64) * scale


def check_stored(stored: torch.Tensor, x: torch.Tensor, scale: float, *, what: str, context: str) -> None:
    """``stored`` (fp8, ``[n, H, D]``) holds ``x / scale`` within :data:`cases.FP8_E4M3`: half an ulp away,
    or exactly +-max where ``|x / scale|`` exceeds it."""
    want = x.cpu().to(torch.float64) / scale
    got = stored.cpu().to(torch.float64)
    top = FP8_E4M3.max_value
    bound = torch.maximum(FP8_E4M3.rel * want.abs(), torch.full_like(want, FP8_E4M3.abs_min))
    inside = want.abs() <= top
    err = torch.where(inside, (got - want).abs() - bound, (got - want.sign() * top).abs())
    checks.record(f"{what}_max_excess", float(err.max()))
    if bool((err > 0).any()) or bool(got.isnan().any()):
        i = tuple(int(j) for j in (err.nan_to_num(math.inf) > 0).nonzero()[0])
        raise AssertionError(f"{context}: {what}: stored {got[i].item():.6g} for x / scale = {want[i].item():.6g} "
                             f"(bound: half an e4m3 ulp, {bound[i].item():.3g}; saturation at +-{top:g})")


def _kv_values(n: int, hkv: int, d: int, gen: torch.Generator, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Random K or V rows whose ``x / scale`` spans the format: most ~N(0, 80), some past +-448 (saturate)
    and some in the subnormal range."""
    x = torch.randn(n, hkv, d, generator=gen) * 80.0
    x.view(-1)[::7] *= 8.0  # ~10% beyond 448: saturation
    x.view(-1)[3::11] *= 1e-4  # subnormals of e4m3 (|x| < 2^-6)
    return (x * scale).to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fp8_write_kv_quantizes_with_saturation(impl, dtype):
    """Every written slot holds k / k_scale (v / v_scale) to half an e4m3 ulp, saturated at +-448; slot
    -1 is skipped and no other slot changes (the cache starts as NaN bytes)."""
    dt = DTYPES[dtype]
    _require_fp8(impl, dt)
    context = f"fp8/write_kv,{dtype}"
    gen = torch.Generator().manual_seed(11)
    num_blocks, bs, hkv, d = 5, 4, 2, 16
    k, v = _kv_values(12, hkv, d, gen, K_SCALE, dt), _kv_values(12, hkv, d, gen, V_SCALE, dt)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:12]
    slots[5] = -1
    dev = impl.device
    k_cache = torch.full((num_blocks, bs, hkv, d), NAN_BYTE, dtype=torch.uint8).view(FP8).to(dev)
    v_cache = k_cache.clone()
    impl.write_kv(k.to(dev), v.to(dev), k_cache, v_cache, slots.to(dev), k_scale=K_SCALE, v_scale=V_SCALE)
    keep = slots >= 0
    for cache, x, scale, what in ((k_cache, k, K_SCALE, "k"), (v_cache, v, V_SCALE, "v")):
        flat = cache.cpu().view(-1, hkv, d)
        check_stored(flat[slots[keep]], x[keep], scale, what=what, context=context)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[keep]] = False
        assert bool((flat[untouched].view(torch.uint8) == NAN_BYTE).all()), f"{context}: {what}: a slot not in " \
                                                                            "slot_mapping was written"


def _fp8_inputs(case: AttentionCase, device, k_scale: float = K_SCALE,
                v_scale: float = V_SCALE) -> tuple[builders.PagedInputs, oracle.OracleResult]:
    """The case's inputs with K/V stored in fp8 (NaN slots stay NaN), and the oracle over the dequantized
    cache. Keys read back as the case's keys, values as 0.8 x its values, whatever the scales: with the
    module's scales stored K ~ 80 x N(0, 1), stored V ~ 200 x N(0, 1) (~3% saturate)."""
    x = builders.build(case, "cpu")
    k8 = quantize(x.k_cache.double(), k_scale)
    v8 = quantize(x.v_cache.double() * 0.8, v_scale)
    fp8 = builders.PagedInputs(q=x.q, k_cache=k8, v_cache=v8, block_tables=x.block_tables, seq_lens=x.seq_lens,
                               cu_seqlens_q=x.cu_seqlens_q, scale=x.scale)
    deq = (dequantize(k8, k_scale), dequantize(v8, v_scale))
    args = (x.q, *deq, x.block_tables, x.seq_lens)
    if case.op == "decode":
        ref = oracle.decode(*args, scale=fp8.scale, sliding_window=case.sliding_window)
    else:
        ref = oracle.prefill(*args, x.cu_seqlens_q, scale=fp8.scale, sliding_window=case.sliding_window)
    moved = builders.PagedInputs(*(t.to(device) if isinstance(t, torch.Tensor) else t
                                   for t in (fp8.q, fp8.k_cache, fp8.v_cache, fp8.block_tables, fp8.seq_lens,
                                             fp8.cu_seqlens_q, fp8.scale)))
    return moved, ref


CASES = [
    AttentionCase("decode", block_size=16, seq_lens=(97, 16, 1, 33)),
    AttentionCase("decode", block_size=16, seq_lens=(97, 16, 1, 33), dtype="bf16", num_heads=8, num_kv_heads=2),
    AttentionCase("decode", block_size=5, seq_lens=(300, 9), dtype="fp32", num_splits=3),
    AttentionCase("prefill", block_size=16, seq_lens=(40, 16, 1, 33), q_lens=(40, 3, 1, 17)),
    AttentionCase("prefill", block_size=16, seq_lens=(40, 33), q_lens=(40, 17), dtype="bf16", query="peaky"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id + ",fp8kv" for c in CASES])
def test_fp8_attention_reads_with_both_scales(impl, case):
    """Decode and prefill over fp8 caches (K and V scales differ; stored values near the format's top)
    equal the oracle over the dequantized caches within q's dtype's bounds."""
    _require_fp8(impl, case.torch_dtype)
    x, ref = _fp8_inputs(case, impl.device)
    out = builders.nan_out(x.q.shape[0], x.q)
    result = builders.call(impl, case, x, out=out, return_lse=impl.capabilities.returns_lse,
                           k_scale=K_SCALE, v_scale=V_SCALE)
    checks.check_attention(result, ref, case.torch_dtype, case.tolerance, context=case.id + ",fp8kv",
                           return_lse=impl.capabilities.returns_lse)
    checks.check_case_tensor(out, ref.out, case, what="out_buffer")


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_fp8_prefix_written_in_one_step_read_in_later_ones(impl, dtype):
    """Step 1 writes a 37-token prompt and runs its prefill; step 2 writes and prefills a 9-token chunk
    over the cached prompt; steps 3-4 decode one token each. Every step is judged against the oracle over
    what the cache holds, and the cache against the tokens written."""
    _run_steps(impl, dtype, K_SCALE, V_SCALE)


#: (id, k_scale, v_scale): each scale alone away from 1.0, the larger one on V, and both left out (read as
#: 1.0): a path that takes a scale of 1.0 (or None) for "unscaled" and drops the other, or applies one
#: tensor's scale to the other, is wrong here whatever the other cases show
SCALE_PAIRS = (
    ("k=1,v=0.004", 1.0, 0.004),
    ("k=0.0125,v=1", 0.0125, 1.0),
    ("k=0.004,v=0.0125", 0.004, 0.0125),
    ("k=None,v=None", None, None),
)


@pytest.mark.parametrize("pair", SCALE_PAIRS, ids=[p[0] for p in SCALE_PAIRS])
def test_fp8_each_scale_on_every_path(impl, pair):
    """The steps of the test above (cache writes, a first prefill, a chunk over the cached prefix, decodes
    over it) with each scale alone away from 1.0, the larger scale on V, and no scales at all."""
    _, k_scale, v_scale = pair
    _run_steps(impl, "fp16", k_scale, v_scale)


SPLIT_CASES = [
    AttentionCase("decode", block_size=5, seq_lens=(300, 9, 41), dtype="fp16", num_splits=3),
    AttentionCase("prefill", block_size=8, seq_lens=(40, 19), q_lens=(7, 19), dtype="fp16", query="peaky"),
]


@pytest.mark.parametrize("pair", SCALE_PAIRS[:3], ids=[p[0] for p in SCALE_PAIRS[:3]])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c.id + ",fp8kv" for c in SPLIT_CASES])
def test_fp8_split_decode_and_cached_prefill_with_each_scale(impl, case, pair):
    """Split-K decode (partials merged by a reduction) and a prefill whose first sequence reads a cached
    prefix, over fp8 caches with each scale alone away from 1.0 or the larger one on V."""
    _require_fp8(impl, case.torch_dtype)
    _, k_scale, v_scale = pair
    x, ref = _fp8_inputs(case, impl.device, k_scale, v_scale)
    out = builders.nan_out(x.q.shape[0], x.q)
    result = builders.call(impl, case, x, out=out, k_scale=k_scale, v_scale=v_scale)
    checks.check_attention(result, ref, case.torch_dtype, case.tolerance, context=f"{case.id},fp8kv,{pair[0]}")


def _run_steps(impl, dtype: str, k_scale: float | None, v_scale: float | None) -> None:
    """A prompt written and prefilled, a chunk written and prefilled over it, two decodes; each step and the
    cache judged (see test_fp8_prefix_written_in_one_step_read_in_later_ones)."""
    dt = DTYPES[dtype]
    _require_fp8(impl, dt)
    ks, vs = (1.0 if k_scale is None else k_scale), (1.0 if v_scale is None else v_scale)
    case = AttentionCase("prefill", block_size=8, seq_lens=(48,), num_heads=4, num_kv_heads=2, head_dim=32,
                         dtype=dtype)
    gen = torch.Generator().manual_seed(case.seed)
    hkv, d, dev = case.num_kv_heads, case.head_dim, impl.device
    total = 48
    table = torch.randperm(total // case.block_size + 2, generator=gen).to(torch.int32)
    k_cache = torch.full((len(table), case.block_size, hkv, d), NAN_BYTE, dtype=torch.uint8).view(FP8).to(dev)
    v_cache = k_cache.clone()
    # the values the module's scales store near the top of the format, whichever scales store them here
    k_all, v_all = _kv_values(total, hkv, d, gen, K_SCALE, dt), _kv_values(total, hkv, d, gen, V_SCALE, dt)
    q_all = torch.randn(total, case.num_heads, d, generator=gen).to(dt)
    scale = 1.0 / math.sqrt(d) / 40  # scores of O(1) with keys of magnitude ~80 x K_SCALE
    tables = table[None].to(dev)
    tag = f"k_scale={k_scale},v_scale={v_scale}"
    for step, (start, stop) in enumerate(((0, 37), (37, 46), (46, 47), (47, 48))):
        pos = torch.arange(start, stop)
        slots = (table[pos // case.block_size].long() * case.block_size + pos % case.block_size)
        impl.write_kv(k_all[start:stop].to(dev), v_all[start:stop].to(dev), k_cache, v_cache, slots.to(dev),
                      k_scale=k_scale, v_scale=v_scale)
        lens = torch.tensor([stop], dtype=torch.int32)
        q = q_all[start:stop]
        cu = torch.tensor([0, stop - start], dtype=torch.int32)
        out = builders.nan_out(q.shape[0], q.to(dev))
        deq_k, deq_v = dequantize(k_cache, ks), dequantize(v_cache, vs)
        ref = oracle.prefill(q, deq_k, deq_v, table[None], lens, cu, scale=scale)
        context = f"fp8/steps,{dtype},{tag},step={step + 1},tokens={start}:{stop}"
        if stop - start == 1:
            got = impl.paged_decode(q.to(dev), k_cache, v_cache, tables, lens.to(dev), scale=scale, out=out,
                                    k_scale=k_scale, v_scale=v_scale)
        else:
            got = impl.paged_prefill(q.to(dev), k_cache, v_cache, tables, lens.to(dev), cu.to(dev), scale=scale,
                                     out=out, k_scale=k_scale, v_scale=v_scale)
        checks.check_attention(got, ref, dt, case.tolerance, context=context)
    pos = torch.arange(total)
    slots = table[pos // case.block_size].long() * case.block_size + pos % case.block_size
    check_stored(k_cache.cpu().view(-1, hkv, d)[slots], k_all, ks, what="k", context=f"fp8/steps,{tag}")
    check_stored(v_cache.cpu().view(-1, hkv, d)[slots], v_all, vs, what="v", context=f"fp8/steps,{tag}")


def test_fp8_copy_blocks_copies_bytes(impl):
    """copy_blocks on fp8 caches: each destination block becomes its source's bytes (NaN bytes included)."""
    _require_fp8(impl)
    gen = torch.Generator().manual_seed(5)
    raw = torch.randint(0, 256, (6, 4, 2, 8), generator=gen, dtype=torch.uint8)
    k_cache, v_cache = raw.view(FP8).to(impl.device), raw.flip(0).contiguous().view(FP8).to(impl.device)
    before_k, before_v = k_cache.cpu().view(torch.uint8).clone(), v_cache.cpu().view(torch.uint8).clone()
    pairs = torch.tensor([[0, 3], [5, 1]], dtype=torch.int64)
    impl.copy_blocks(k_cache, v_cache, pairs.to(impl.device))
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[[3, 1]], want_v[[3, 1]] = before_k[[0, 5]], before_v[[0, 5]]
    assert torch.equal(k_cache.cpu().view(torch.uint8), want_k), "fp8/copy_blocks: k_cache bytes differ"
    assert torch.equal(v_cache.cpu().view(torch.uint8), want_v), "fp8/copy_blocks: v_cache bytes differ"

