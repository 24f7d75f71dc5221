"""The batched torch attention (``refengine.model.batched_attention``) against ``kernels.reference`` on
engine-shaped steps; the full launcher contract is the conformance gate's (``--impl torch-batched``).

A step mixing decodes and prefill chunks splits into two padded groups; the cache's unused slots hold
NaN (never read into a result); a cache laid out so that its slots cannot be flattened into one index
takes the (block, offset) gather and must agree bit for bit with the fast path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pagedbench.kernels import reference
from pagedbench.refengine.model.batched_attention import _slot_view, build_padded_layout, paged_prefill

NUM_BLOCKS, BLOCK_SIZE, HKV, HQ, D = 24, 4, 2, 8, 16
#: float32 against the float32 reference: the same sums in another order (observed <= 5e-7)
FP32_ATOL = 4e-6


def step_case(seed: int = 0):
    """Sequences (seq_len, q_len): two decodes, a whole prompt, a chunk, a 1-token prompt."""
    lens = [(9, 1), (17, 1), (6, 6), (13, 5), (1, 1)]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, seq_lens, q_lens = [], [], []
    for s_len, q_len in lens:
        n = -(-s_len // BLOCK_SIZE)
        tables.append(blocks[:n] + [NUM_BLOCKS + 99] * (5 - n))  # padding entries out of range: never read
        blocks = blocks[n:]
        seq_lens.append(s_len)
        q_lens.append(q_len)
    k_cache = torch.full((NUM_BLOCKS, BLOCK_SIZE, HKV, D), math.nan)
    v_cache = torch.full_like(k_cache, math.nan)
    for t, s_len in zip(tables, seq_lens):  # only the slots a sequence owns hold values
        for p in range(s_len):
            k_cache[t[p // BLOCK_SIZE], p % BLOCK_SIZE] = torch.randn(HKV, D, generator=g)
            v_cache[t[p // BLOCK_SIZE], p % BLOCK_SIZE] = torch.randn(HKV, D, generator=g)
    q = torch.randn(sum(q_lens), HQ, D, generator=g)
    cu = torch.tensor(np.concatenate(([0], np.cumsum(q_lens))), dtype=torch.int32)
    return q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens,
                                                                                       dtype=torch.int32), cu


def test_mixed_step_splits_into_a_decode_and_a_prefill_group():
    _, _, _, tables, seq_lens, cu = step_case()
    layout = build_padded_layout(tables.numpy(), seq_lens.numpy(), np.diff(cu.numpy()), BLOCK_SIZE)
    assert [(g.num_seqs, g.max_query_len, g.max_seq_len) for g in layout.groups] == [(3, 1, 17), (2, 6, 13)]


def test_mixed_step_matches_the_reference_and_ignores_nan_in_unowned_slots():
    q, k, v, tables, seq_lens, cu = step_case()
    got, lse = paged_prefill(q, k, v, tables, seq_lens, cu, return_lse=True, validate=False)
    want, want_lse = reference.paged_prefill(q, k, v, tables, seq_lens, cu, return_lse=True, validate=False)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_ATOL)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=FP32_ATOL)
    no_lse = paged_prefill(q, k, v, tables, seq_lens, cu, validate=False)  # the SDPA path
    torch.testing.assert_close(no_lse, want, rtol=0, atol=FP32_ATOL)


def test_a_cache_without_a_slot_view_takes_the_block_offset_gather():
    q, k, v, tables, seq_lens, cu = step_case(seed=1)
    # the same values with blocks not mergeable with offsets (stride(0) != block_size * stride(1))
    k2 = k.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    v2 = v.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    assert _slot_view(k) is not None and _slot_view(k2) is None
    fast = paged_prefill(q, k, v, tables, seq_lens, cu, validate=False)
    slow = paged_prefill(q, k2, v2, tables, seq_lens, cu, validate=False)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_sequence_with_no_keys_gets_zeros_not_nan(return_lse):
    q, k, v, tables, seq_lens, _ = step_case()
    seq_lens = seq_lens.clone()
    seq_lens[1] = 0
    from pagedbench.refengine.model.batched_attention import paged_decode

    res = paged_decode(q[:5], k, v, tables, seq_lens, return_lse=return_lse, validate=False)
    out = res[0] if return_lse else res
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()
    if return_lse:
        assert torch.isneginf(res[1][1]).all()
