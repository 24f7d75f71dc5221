"""paged_prefill against the float64 oracle: causal queries that are the last tokens of each sequence.

One control case mixes a full prefill, a prefix-hit / chunked tail and single queries; then one axis at a
time; the cartesian grid runs under ``-m slow``. Equivalences between operations are in
test_metamorphic.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from pagedbench.conformance.gate import builders, checks
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

CONTROL = AttentionCase("prefill", block_size=16, seq_lens=(40, 16, 1, 33), q_lens=(40, 3, 1, 17))


def _axes() -> list[AttentionCase]:
    cases = [CONTROL]
    cases += [vary(CONTROL, block_size=b, seq_lens=edge_lengths(b), q_lens=None) for b in BLOCK_SIZES]
    cases += [vary(CONTROL, dtype=d) for d in DTYPES if d != CONTROL.dtype]
    cases += [vary(CONTROL, num_heads=h, num_kv_heads=k) for h, k in HEAD_LAYOUTS]
    cases += [vary(CONTROL, head_dim=d) for d in HEAD_DIMS if d != CONTROL.head_dim]
    cases += [vary(CONTROL, query="peaky"), vary(CONTROL, pad="garbage")]
    cases += [vary(CONTROL, sliding_window=w) for w in (1, 7, 16)]
    cases += [vary(CONTROL, seq_lens=(LONG_LEN, 20), q_lens=(16, 20))]  # a chunk at the end of a long context
    return cases


def _full_grid() -> list[AttentionCase]:
    cases = []
    for b, (h, k), d, dt in itertools.product(BLOCK_SIZES, HEAD_LAYOUTS, HEAD_DIMS, DTYPES):
        lens = (*edge_lengths(b), 300)
        base = AttentionCase("prefill", block_size=b, seq_lens=lens, num_heads=h, num_kv_heads=k, head_dim=d,
                             dtype=dt, q_lens=tuple(min(n, 2 * b + 1) for n in lens))
        cases += [base, vary(base, query="peaky", sliding_window=b + 2)]
    return cases


@pytest.mark.parametrize("case", _axes(), ids=case_ids(_axes()))
def test_prefill_matches_oracle(impl, case):
    run_and_check(impl, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", _full_grid(), ids=case_ids(_full_grid()))
def test_prefill_full_grid(impl, case):
    run_and_check(impl, case)


LSE_CASES = [vary(CONTROL, seq_lens=(0, 17, 9), q_lens=(0, 17, 2)),
             vary(CONTROL, sliding_window=5, dtype="fp32")]


@pytest.mark.parametrize("case", LSE_CASES, ids=case_ids(LSE_CASES))
def test_prefill_lse(impl, case):
    """LSE of every query row matches the oracle (a sequence with no queries owns no rows)."""
    run_and_check(impl, case, return_lse=True)


SPIKE_CASES = [AttentionCase("prefill", block_size=b, seq_lens=(2 * b + 3,), num_heads=10, num_kv_heads=2)
               for b in (1, 5, 16)]


@pytest.mark.parametrize("case", SPIKE_CASES, ids=case_ids(SPIKE_CASES))
def test_prefill_spike_selects_its_value(impl, case):
    """Key p dominates every query at or after p: those rows must equal V[p]; queries before p must not
    see it (causality), and match the oracle."""
    n, bs = case.seq_lens[0], case.block_size
    positions = sorted({p for p in (0, bs - 1, bs, 2 * bs - 1, 2 * bs, n - 1) if 0 <= p < n})
    q_len = 4
    case = vary(case, seq_lens=(n,) * len(positions), q_lens=(q_len,) * len(positions))
    x = builders.with_spikes(builders.build(case, impl.device), positions, seed=case.seed)
    out = builders.call(impl, case, x, out=builders.nan_out(x.q.shape[0], x.q))
    ref = builders.expected(case, x)
    checks.check_case_tensor(out, ref.out, case, what="out")
    group = case.num_heads // case.num_kv_heads
    for s, p in enumerate(positions):
        v_p = x.v_cache[int(x.block_tables[s, p // bs]), p % bs].cpu().to(torch.float64)
        for i, pos in enumerate(range(n - q_len, n)):
            if pos >= p:
                row = out[s * q_len + i]
                checks.check_case_tensor(row, v_p[torch.arange(case.num_heads) // group], case,
                                         what=f"spike@{p},query@{pos}")
