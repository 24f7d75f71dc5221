"""``LLM(..., kv_cache_dtype="fp8_e4m3")``: K and V stored as float8_e4m3fn (scales 1.0), a byte per element.

The measure of "close to float32": greedy continuations of 8 random prompts (16 tokens each) by the tiny
random-weight model, fp8 KV against float32 KV. Every prompt's first token (the prefill's, read from a
cache written in the same step) must be equal, and on average at least half of each continuation must
be generated before the two first differ (e4m3 keeps 3 mantissa bits: a near-tie between two logits may
flip, after which the continuations are unrelated; an unscaled or misquantized cache makes them differ
from the first tokens on).

Every attention backend takes fp8 caches with the same rule (write ``k / k_scale`` in float32, saturated at
+-448, rounded to nearest; read ``stored * scale``): the CPU default ``torch-batched`` is checked against
the ``torch`` references byte for byte on what it writes and within each dtype's tolerance on what it
attends, and through ``LLM`` on its greedy tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedbench.kernels import reference
from pagedbench.refengine import LLM, ModelConfig, SamplingParams
from pagedbench.refengine.cli import named_configs_path
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.model import batched_attention
from pagedbench.refengine.model.attention_backend import AttentionMetadata, get_attention_backend

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
FP8 = torch.float8_e4m3fn
#: the engine's CPU backends (triton runs interpreted: slow)
BACKENDS = ["torch", "torch-batched", pytest.param("triton", marks=pytest.mark.slow)]
#: torch-batched against the torch reference over the same fp8 cache: the same dequantized values, sums
#: in another order, then q's dtype's rounding; relative to the output's largest magnitude
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape and bool(got.isfinite().all())
    bound = TOL[dtype] * float(want.float().abs().max())
    err = float((got.float() - want.float()).abs().max())
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_yaml(named_configs_path(), name="tiny")


def _prompts(vocab_size: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(1, vocab_size, (n,), generator=gen).tolist()}
            for n in (5, 17, 33, 9, 1, 24, 12, 40)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_kv_cache_tokens_close_to_float32(tiny, backend):
    prompts = _prompts(tiny.vocab_size)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(tiny, seed=0, attention_backend=backend, block_size=8, kv_cache_dtype=kv)
        assert llm.pool.k(0).dtype == (torch.float32 if kv == "auto" else torch.float8_e4m3fn)
        runs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    agree = [_common_prefix(a, b) for a, b in zip(runs["auto"], runs["fp8_e4m3"])]
    assert all(n >= 1 for n in agree), f"a first token differs: common prefixes {agree}"
    assert sum(agree) / (len(agree) * GREEDY.max_tokens) >= 0.5, f"common prefixes {agree} of 16"


@pytest.mark.parametrize("backend", ["torch", "torch-batched", "triton"])
def test_fp8_kv_cache_holds_four_times_the_float32_blocks(tiny, backend):
    budget = 1 << 20
    fp32 = LLM(tiny, seed=0, attention_backend=backend, kv_cache_memory=budget)
    fp8 = LLM(tiny, seed=0, attention_backend=backend, kv_cache_memory=budget, kv_cache_dtype="fp8_e4m3")
    assert fp8.pool.num_blocks == 4 * fp32.pool.num_blocks


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, fp8_e4m3; got 'fp8'"),
    ({"kv_cache_dtype": "fp8_e4m3", "batch_invariant": True},
     "batch_invariant=True does not support kv_cache_dtype='fp8_e4m3'; use kv_cache_dtype='auto'"),
])
def test_bad_kv_cache_dtype_is_rejected(tiny, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(tiny, seed=0, **kwargs)


@pytest.mark.slow
def test_fp8_kv_cache_triton_backend_matches_torch(tiny):
    """The Triton kernels (interpreted here) give the torch references' fp8 tokens."""
    prompts = _prompts(tiny.vocab_size)[:3]
    got = {b: [o.outputs[0].token_ids for o in LLM(tiny, seed=0, attention_backend=b, block_size=8,
                                                     kv_cache_dtype="fp8_e4m3").generate(prompts, GREEDY)]
           for b in ("torch", "triton")}
    assert got["torch"] == got["triton"]


def test_fp8_default_backend_greedy_tokens_equal_the_torch_backends(tiny):
    """The CPU default (``torch-batched``) serves fp8 and generates the ``torch`` backend's greedy tokens."""
    prompts = _prompts(tiny.vocab_size)
    got = {}
    for backend in (None, "torch"):
        llm = LLM(tiny, seed=0, attention_backend=backend, block_size=8, kv_cache_dtype="fp8_e4m3")
        assert llm.pool.k(0).dtype == FP8
        got[llm.model.attention_backend.name] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert set(got) == {"torch-batched", "torch"}
    assert got["torch-batched"] == got["torch"]


NUM_BLOCKS, BLOCK_SIZE, HKV, HQ, D = 20, 4, 2, 4, 16
NAN_BYTE = 0x7F  # float8_e4m3fn NaN: slots nobody wrote must never reach a result


def _kv(n: int, gen: torch.Generator, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose ``x / scale`` spans e4m3: most ~N(0, 40), some past +-448 (saturated), some subnormal."""
    x = torch.randn(n, HKV, D, generator=gen) * 40.0
    x.view(-1)[::9] *= 16.0
    x.view(-1)[4::13] *= 1e-4
    return (x * scale).to(dtype)


def _fp8_step(seed: int, dtype: torch.dtype):
    """A step of two decodes, a whole prompt and a chunk over shuffled blocks: its metadata, its new
    tokens' q, k, v, and the earlier tokens' k, v with their slots."""
    gen = torch.Generator().manual_seed(seed)
    lens = [(11, 1), (6, 1), (7, 7), (13, 5)]  # (seq_len, query_len)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, old_slots, new_slots = [], [], []
    for seq_len, q_len in lens:
        n = -(-seq_len // BLOCK_SIZE)
        table, blocks = blocks[:n], blocks[n:]
        tables.append(table)
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
        old_slots += slots[:seq_len - q_len]
        new_slots += slots[seq_len - q_len:]
    meta = AttentionMetadata.build(slot_mapping=new_slots, block_tables=tables, seq_lens=[s for s, _ in lens],
                                   query_lens=[q for _, q in lens], block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    new = [_kv(len(new_slots), gen, 1.0, dtype) for _ in range(2)]
    old = [_kv(len(old_slots), gen, 1.0, dtype) for _ in range(2)]
    q = (torch.randn(len(new_slots), HQ, D, generator=gen) / 40).to(dtype)  # scores of order 1
    return meta, q, new, old, torch.tensor(old_slots)


def _nan_caches() -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((NUM_BLOCKS, BLOCK_SIZE, HKV, D), NAN_BYTE, dtype=torch.uint8).view(FP8)
    return k, k.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_batched_backend_fp8_equals_the_torch_backend(dtype, seed):
    """The engine's layer call (write the step's K/V, attend) on fp8 caches: the same bytes written and
    the same output within q's dtype's tolerance."""
    meta, q, (k, v), (k_old, v_old), old_slots = _fp8_step(seed, dtype)
    results = {}
    for name in ("torch", "torch-batched"):
        backend = get_attention_backend(name)
        k_cache, v_cache = _nan_caches()
        reference.write_kv(k_old, v_old, k_cache, v_cache, old_slots)  # the earlier steps' tokens
        out = backend.forward(q, k, v, k_cache, v_cache, backend.plan(meta, BLOCK_SIZE), 1 / math.sqrt(D))
        results[name] = out, k_cache, v_cache
    want, got = results["torch"], results["torch-batched"]
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), "k_cache bytes differ"
    assert torch.equal(got[2].view(torch.uint8), want[2].view(torch.uint8)), "v_cache bytes differ"
    assert_close(got[0], want[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("k_scale", "v_scale"), [(0.25, 3.0), (None, 0.5)])
def test_torch_batched_launchers_fp8_with_scales_equal_the_references(dtype, k_scale, v_scale):
    """``batched_attention``'s launcher contract with per-tensor scales: write_kv stores the references'
    bytes (slot -1 skipped), paged_decode and paged_prefill read ``stored * scale`` as they do."""
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:8]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).view(-1)
    slots = torch.cat([slots[torch.randperm(len(slots), generator=gen)], torch.tensor([-1])])  # -1: skipped
    n = len(slots)
    k, v = _kv(n, gen, k_scale or 1.0, dtype), _kv(n, gen, v_scale or 1.0, dtype)
    caches = {}
    for name, impl in (("torch", reference), ("torch-batched", batched_attention)):
        k_cache, v_cache = _nan_caches()
        impl.write_kv(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
        caches[name] = k_cache, v_cache
    for want, got in zip(caches["torch"], caches["torch-batched"]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    k_cache, v_cache = caches["torch"]
    tables = blocks[:4].view(2, 2).to(torch.int32)
    seq_lens = torch.tensor([8, 7], dtype=torch.int32)
    kw = {"k_scale": k_scale, "v_scale": v_scale}
    q = (torch.randn(2, HQ, D, generator=gen) / (40 * (k_scale or 1.0))).to(dtype)
    got = batched_attention.paged_decode(q, k_cache, v_cache, tables, seq_lens, **kw)
    want = reference.paged_decode(q, k_cache, v_cache, tables, seq_lens, **kw)
    assert_close(got, want, dtype)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = (torch.randn(8, HQ, D, generator=gen) / (40 * (k_scale or 1.0))).to(dtype)
    got = batched_attention.paged_prefill(q, k_cache, v_cache, tables, seq_lens, cu, **kw)
    want = reference.paged_prefill(q, k_cache, v_cache, tables, seq_lens, cu, **kw)
    assert_close(got, want, dtype)
