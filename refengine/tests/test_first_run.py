"""What a first run relies on: ``print(llm.stats)`` shows throughput, and the KV pool is NaN-poisoned in
tests (the suite's conftest) but, outside them, not filled at all on construction."""

from __future__ import annotations

import torch
from pagedbench.refengine import LLM, SamplingParams

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


def test_printed_stats_show_tokens_per_second():
    llm = LLM(TINY, num_blocks=8, block_size=4)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    s = llm.stats
    text = str(s)
    assert f"input {s.input_tokens_per_s:.1f} tok/s" in text and f"output {s.output_tokens_per_s:.1f} tok/s" in text
    assert s.output_tokens_per_s > 0 and "1 requests (0 rejected), 3 prompt + 4 generated tokens" in text


def test_the_pool_is_poisoned_in_tests_and_zero_when_asked():
    k, v = LLM(TINY, num_blocks=8, block_size=4).pool.kv_caches()[0]
    assert torch.isnan(k).all() and torch.isnan(v).all()  # the suite's PAGEDBENCH_POISON_KV=1
    k, v = LLM(TINY, num_blocks=8, block_size=4, poison_kv_cache=False).pool.kv_caches()[0]
    assert not k.any() and not v.any()


def test_poisoning_follows_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDBENCH_POISON_KV", "0")
    assert not LLM(TINY, num_blocks=8, block_size=4).pool.kv_caches()[0][0].isnan().any()
    assert LLM(TINY, num_blocks=8, block_size=4, poison_kv_cache=True).pool.kv_caches()[0][0].isnan().all()
