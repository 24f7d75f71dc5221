"""The tiny Hugging Face Llama the engine tests compare against: 2 layers, GQA 4/2, vocabulary 256.

Its weights are spread out (norms near 1, embeddings N(0, 1), projections N(0, 1/fan_in)) so the top
tokens are not decided by rounding: greedy, beam and logprob comparisons then test the engine, not ties.
"""

from __future__ import annotations

import math

import torch


def tiny_llama(seed: int = 0):
    """A seeded ``transformers.LlamaForCausalLM`` in eval mode (float32)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model
