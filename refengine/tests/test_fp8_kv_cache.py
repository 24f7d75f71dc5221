"""``LLM(..., kv_cache_dtype="fp8_e4m3")``: K and V stored as float8_e4m3fn (scales 1.0), a byte per element.

The measure of "close to float32": greedy continuations of 8 random prompts (16 tokens each) by the tiny
random-weight model, fp8 KV against float32 KV. Every prompt's first token (the prefill's, read from a
cache written in the same step) must be equal, and on average at least half of each continuation must
be generated before the two first differ (e4m3 keeps 3 mantissa bits: a near-tie between two logits may
flip, after which the continuations are unrelated; an unscaled or misquantized cache makes them differ
from the first tokens on).
"""

from __future__ import annotations

import pytest
import torch
from pagedbench.refengine import LLM, ModelConfig, SamplingParams
from pagedbench.refengine.cli import named_configs_path
from pagedbench.refengine.errors import InvalidArgumentError

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_yaml(named_configs_path(), name="tiny")


def _prompts(vocab_size: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(1, vocab_size, (n,), generator=gen).tolist()}
            for n in (5, 17, 33, 9, 1, 24, 12, 40)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_fp8_kv_cache_tokens_close_to_float32(tiny):
    prompts = _prompts(tiny.vocab_size)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(tiny, seed=0, attention_backend="torch", block_size=8, kv_cache_dtype=kv)
        assert llm.pool.k(0).dtype == (torch.float32 if kv == "auto" else torch.float8_e4m3fn)
        runs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    agree = [_common_prefix(a, b) for a, b in zip(runs["auto"], runs["fp8_e4m3"])]
    assert all(n >= 1 for n in agree), f"a first token differs: common prefixes {agree}"
    assert sum(agree) / (len(agree) * GREEDY.max_tokens) >= 0.5, f"common prefixes {agree} of 16"


def test_fp8_kv_cache_holds_four_times_the_float32_blocks(tiny):
    budget = 1 << 20
    fp32 = LLM(tiny, seed=0, attention_backend="torch", kv_cache_memory=budget)
    fp8 = LLM(tiny, seed=0, attention_backend="torch", kv_cache_memory=budget, kv_cache_dtype="fp8_e4m3")
    assert fp8.pool.num_blocks == 4 * fp32.pool.num_blocks


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, fp8_e4m3; got 'fp8'"),
    ({"kv_cache_dtype": "fp8_e4m3", "attention_backend": "torch-batched"},
     "kv_cache_dtype='fp8_e4m3' needs the attention backend 'triton' or 'torch'; the model has 'torch-batched'"),
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
