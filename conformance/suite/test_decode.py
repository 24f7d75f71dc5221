"""paged_decode against the float64 oracle: a control case plus one axis at a time, spikes, splits, LSE.

Every call gets NaN-poisoned caches (only the slots of each sequence hold values) and a NaN-filled
``out=``; the full cartesian grid runs under ``-m slow``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch
from pagedbench.conformance.gate import builders, checks, oracle
from pagedbench.conformance.gate.cases import (
    BLOCK_SIZES,
    DTYPES,
    HEAD_DIMS,
    HEAD_LAYOUTS,
    LONG_LEN,
    AttentionCase,
    case_ids,
    edge_lengths,
    vary,
)
from pagedbench.conformance.gate.harness import run_and_check

CONTROL = AttentionCase("decode", block_size=16, seq_lens=(97, 16, 1, 33))


def _axes() -> list[AttentionCase]:
    cases = [CONTROL]
    cases += [vary(CONTROL, block_size=b, seq_lens=edge_lengths(b)) for b in BLOCK_SIZES]
    cases += [vary(CONTROL, dtype=d) for d in DTYPES if d != CONTROL.dtype]
    cases += [vary(CONTROL, num_heads=h, num_kv_heads=k) for h, k in HEAD_LAYOUTS]
    cases += [vary(CONTROL, head_dim=d) for d in HEAD_DIMS if d != CONTROL.head_dim]
    cases += [vary(CONTROL, query="peaky"), vary(CONTROL, pad="garbage")]
    cases += [vary(CONTROL, sliding_window=w) for w in (1, 7, 16, 50)]
    cases += [vary(CONTROL, seq_lens=(LONG_LEN,)), vary(CONTROL, seq_lens=(LONG_LEN, 5), query="peaky")]
    return cases


def _full_grid() -> list[AttentionCase]:
    cases = []
    for b, (h, k), d, dt in itertools.product(BLOCK_SIZES, HEAD_LAYOUTS, HEAD_DIMS, DTYPES):
        base = AttentionCase("decode", block_size=b, seq_lens=(*edge_lengths(b), LONG_LEN), num_heads=h,
                             num_kv_heads=k, head_dim=d, dtype=dt)
        cases += [base, vary(base, query="peaky", sliding_window=2 * b + 1)]
    return cases


@pytest.mark.parametrize("case", _axes(), ids=case_ids(_axes()))
def test_decode_matches_oracle(impl, case):
    run_and_check(impl, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", _full_grid(), ids=case_ids(_full_grid()))
def test_decode_full_grid(impl, case):
    run_and_check(impl, case)


LSE_CASES = [vary(CONTROL, seq_lens=(0, 17, 1, 97)), vary(CONTROL, seq_lens=(0, 40), sliding_window=9),
             vary(CONTROL, seq_lens=(0,), dtype="fp32")]


@pytest.mark.parametrize("case", LSE_CASES, ids=case_ids(LSE_CASES))
def test_decode_lse_and_fully_masked_rows(impl, case):
    """LSE matches the oracle; a sequence of length 0 gives output exactly 0 and LSE -inf (never NaN)."""
    out = run_and_check(impl, case, return_lse=True)
    empty = [s for s, n in enumerate(case.seq_lens) if n == 0]
    assert torch.equal(out[empty].cpu(), torch.zeros_like(out[empty].cpu())), f"{case.id}: masked row not 0"


SPIKE_CASES = [AttentionCase("decode", block_size=b, seq_lens=(2 * b + 3,), num_heads=10, num_kv_heads=2)
               for b in BLOCK_SIZES]


def spike_positions(block_size: int, seq_len: int) -> list[int]:
    """Positions next to every block edge of the first two blocks, plus the first and the last."""
    b = block_size
    return sorted({p for p in (0, 1, b - 1, b, b + 1, 2 * b - 1, 2 * b, seq_len - 1) if 0 <= p < seq_len})


@pytest.mark.parametrize("case", SPIKE_CASES, ids=case_ids(SPIKE_CASES))
def test_decode_spike_selects_its_value(impl, case):
    """Key p dominates: the output must be V[p] (of the query head's KV head) for every p near an edge —
    each logical position maps to the right physical slot, with the right GQA head."""
    n = case.seq_lens[0]
    positions = spike_positions(case.block_size, n)
    case = vary(case, seq_lens=(n,) * len(positions))
    x = builders.with_spikes(builders.build(case, impl.device), positions, seed=case.seed)
    out = builders.call(impl, case, x, out=builders.nan_out(len(positions), x.q))
    group = case.num_heads // case.num_kv_heads
    bs = case.block_size
    for s, p in enumerate(positions):
        v_p = x.v_cache[int(x.block_tables[s, p // bs]), p % bs].cpu().to(torch.float64)  # [hkv, d]
        want = v_p[torch.arange(case.num_heads) // group]
        checks.check_case_tensor(out[s], want, case, what=f"spike@{p}")


SPLIT_CASES = [vary(CONTROL, seq_lens=(300,)), vary(CONTROL, seq_lens=(300, 1, 0), block_size=5),
               vary(CONTROL, seq_lens=(129, 64), dtype="bf16", sliding_window=70)]
SPLIT_COUNTS = (1, 2, 3, 8, 64)


@pytest.mark.parametrize("case", SPLIT_CASES, ids=case_ids(SPLIT_CASES))
def test_decode_every_split_count_agrees(impl, case):
    """num_splits=1..64 (more splits than key tiles leaves some empty) all match the oracle and each
    other within the dtype's bounds, with LSE, and never give NaN."""
    x = builders.build(case, impl.device)
    ref = builders.expected(case, x)
    outs = {n: run_and_check(impl, case, x=x, ref=ref, return_lse=True, num_splits=n) for n in SPLIT_COUNTS}
    base = outs[1].cpu().to(torch.float64)
    for n, out in outs.items():
        checks.check_case_tensor(out, base, case, what=f"splits={n}_vs_1")


PADDED_OUT_CASE = vary(CONTROL, head_dim=24, seq_lens=(300, 33))  # head_dim short of its power of two


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_writes_nothing_outside_out(impl, num_splits):
    """``out=`` a view into a larger buffer, each row padded past head_dim and a spare row after it: the
    padding and the spare row keep their sentinel, with one split and through the split reduction."""
    case = PADDED_OUT_CASE
    x = builders.build(case, impl.device)
    num_seqs, num_heads, head_dim = x.q.shape
    sentinel = 7.0
    buffer = torch.full((num_seqs + 1, num_heads, head_dim + 8), sentinel, dtype=x.q.dtype, device=x.q.device)
    out = buffer[:num_seqs, :, :head_dim]
    out.fill_(math.nan)
    got = builders.call(impl, case, x, out=out, num_splits=num_splits)
    checks.check_case_tensor(got, builders.expected(case, x).out, case, what="out")
    want = torch.full_like(buffer, sentinel)
    want[:num_seqs, :, :head_dim] = out
    checks.assert_bitwise_equal(buffer, want, what="buffer around out", context=f"{case.id},splits={num_splits}")


CONTIGUOUS = [(16, (97, 1, 33), "fp16"), (8, (1, 8, 9), "fp32"), (40, (40, 3), "bf16")]
CONTIGUOUS_IDS = [f"contiguous/max={m},ctx={'+'.join(map(str, s))},{d}" for m, s, d in CONTIGUOUS]


@pytest.mark.parametrize("max_len,seq_lens,dtype", CONTIGUOUS, ids=CONTIGUOUS_IDS)
def test_contiguous_decode_matches_oracle(impl, max_len, seq_lens, dtype):
    """The non-paged baseline: rows past seq_len are NaN and must not be read."""
    max_len = max(max_len, *seq_lens)
    case = AttentionCase("decode", block_size=max_len, seq_lens=seq_lens, dtype=dtype)  # one block per seq
    gen = torch.Generator().manual_seed(case.seed)
    dt = case.torch_dtype
    shape = (len(seq_lens), max_len, case.num_kv_heads, case.head_dim)
    k, v = torch.randn(shape, generator=gen).to(dt), torch.randn(shape, generator=gen).to(dt)
    for s, n in enumerate(seq_lens):
        k[s, n:], v[s, n:] = math.nan, math.nan
    q = torch.randn(len(seq_lens), case.num_heads, case.head_dim, generator=gen).to(dt)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    tables = torch.arange(len(seq_lens), dtype=torch.int32)[:, None]  # the oracle sees k as a paged cache
    ref = oracle.decode(q, k, v, tables, lens)
    dev = impl.device
    out = builders.nan_out(q.shape[0], q.to(dev))
    result = impl.contiguous_decode(q.to(dev), k.to(dev), v.to(dev), lens.to(dev), out=out)
    checks.check_attention(result, ref, dt, case.tolerance, context=f"contiguous/{case.id}")


SHARED_CASES = [AttentionCase("decode", block_size=5, seq_lens=(23, 12, 7), num_heads=8, num_kv_heads=2),
                AttentionCase("prefill", block_size=5, seq_lens=(23, 12, 7), q_lens=(4, 12, 2), num_heads=8,
                              num_kv_heads=2)]


@pytest.mark.parametrize("case", SHARED_CASES, ids=case_ids(SHARED_CASES))
def test_sequences_sharing_prefix_blocks(impl, case):
    """Forked / prefix-cached sequences point at the same physical blocks: sequences 1 and 2 share
    sequence 0's first block (and sequence 1 its second one too)."""
    x = builders.build(case, impl.device)
    tables = x.block_tables.clone()
    tables[1, :2] = x.block_tables[0, :2]
    tables[2, 0] = x.block_tables[0, 0]
    run_and_check(impl, case, x=replace(x, block_tables=tables))
