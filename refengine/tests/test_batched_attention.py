"""The batched torch attention (``refengine.model.batched_attention``) against ``kernels.reference`` on
engine-shaped steps; the full launcher contract is the conformance gate's (``--impl torch-batched``).

A step mixing decodes and prefill chunks splits into padded groups (decodes bucketed by length, so none
is padded past twice its length); the cache's unused slots hold
NaN (never read into a result); a cache laid out so that its slots cannot be flattened into one index
takes the (block, offset) gather and must agree bit for bit with the fast path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pagedbench.kernels import reference
from pagedbench.refengine.model.batched_attention import (
    MIN_DECODE_BUCKET,
    _slot_view,
    build_padded_layout,
    paged_decode,
    paged_prefill,
)

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
    seq_lens, tables = seq_lens.clone(), tables.clone()
    seq_lens[1] = 0
    tables[1] = NUM_BLOCKS + 99  # a sequence with no key uses none of its table: never read
    res = paged_decode(q[:5], k, v, tables, seq_lens, return_lse=return_lse, validate=False)
    out = res[0] if return_lse else res
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out).all()
    if return_lse:
        assert torch.isneginf(res[1][1]).all()


def test_decodes_of_spread_lengths_are_bucketed_and_match_the_reference():
    """Decodes of 1 to ~4x MIN_DECODE_BUCKET keys, in shuffled order: each group pads its members to at
    most twice their length (or to the smallest bucket), and the output rows land where they belong."""
    g = torch.Generator().manual_seed(3)
    b = MIN_DECODE_BUCKET
    lens = [b * 4 - 3, 1, b + 1, 5, 2 * b, b, 3 * b, 2 * b + 1]
    block_size, hkv, hq, d = 4, 2, 4, 8
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), max(need)), num_blocks + 7, dtype=torch.int32)  # unused: out of range
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(blocks[:n])
        blocks = blocks[n:]
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    q = torch.randn(len(lens), hq, d, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    layout = build_padded_layout(tables.numpy(), seq_lens.numpy(), np.ones(len(lens), np.int64), block_size)
    assert sum(grp.num_seqs for grp in layout.groups) == len(lens) and len(layout.groups) == 3
    for grp in layout.groups:
        members = [lens[r] for r in grp.token_rows.tolist()]
        assert grp.max_seq_len == max(members) and grp.max_seq_len <= max(b, 2 * min(members) - 1)
    got, lse = paged_decode(q, k, v, tables, seq_lens, return_lse=True, validate=False)
    want, want_lse = reference.paged_decode(q, k, v, tables, seq_lens, return_lse=True, validate=False)
    torch.testing.assert_close(got, want, rtol=0, atol=FP32_ATOL)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=FP32_ATOL)
    torch.testing.assert_close(paged_decode(q, k, v, tables, seq_lens, validate=False), want, rtol=0,
                               atol=FP32_ATOL)  # the SDPA path


def test_unchecked_tables_too_narrow_for_the_lengths_are_refused_not_read_past():
    q, k, v, tables, seq_lens, _ = step_case()
    with pytest.raises(ValueError, match="block tables of 0 blocks cannot hold 17 keys"):
        paged_decode(q[:5], k, v, tables[:, :0], seq_lens, validate=False)
