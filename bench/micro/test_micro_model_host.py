"""Host-side work around the model each step: building the attention metadata (python lists to tensors)
and sampling one token with temperature and top-p."""

from __future__ import annotations

import pytest
import torch
from pagedbench.refengine import AttentionMetadata, SamplingParams
from pagedbench.refengine.model.sampling import child_generator, sample_token

pytestmark = pytest.mark.micro

NUM_SEQS, CONTEXT, BLOCK_SIZE, VOCAB = 64, 1000, 16, 32000
TABLES = [[(s * 997 + b * 13) % 4096 for b in range(-(-CONTEXT // BLOCK_SIZE))] for s in range(NUM_SEQS)]
SLOTS = [t[-1] * BLOCK_SIZE + (CONTEXT - 1) % BLOCK_SIZE for t in TABLES]


def build() -> AttentionMetadata:
    return AttentionMetadata.build(slot_mapping=SLOTS, block_tables=TABLES, seq_lens=[CONTEXT] * NUM_SEQS,
                                   query_lens=[1] * NUM_SEQS)


def test_micro_attention_metadata_build(run_micro):
    meta = build()
    assert meta.is_decode_only and tuple(meta.block_tables.shape) == (NUM_SEQS, len(TABLES[0]))
    run_micro(build, tuple)


def test_micro_sampler(run_micro):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_p=0.95)

    def sample(gen):
        return [sample_token(logits, params, gen) for _ in range(2)]

    assert sample(child_generator(0, 0)) == sample(child_generator(0, 0))  # seeded: reproducible
    run_micro(sample, lambda: (child_generator(0, 0),))
