"""GQA groups of 12 and 16 query heads per KV head (Llama-3.1-405B has 16), against the float64 oracle.

The rest of the suite stops at groups of 8. A kernel that tiles a group in 8 heads, or sizes a per-group
buffer for 8, is right up to there and wrong past it. Each layout has 2 KV heads (so the mapping
``kv_head = h // group`` is observable) or one; the spike test makes each query head's output equal to
one value row of its KV head, so a wrong mapping shows head by head.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from pagedbench.conformance.gate import builders, checks
from pagedbench.conformance.gate.cases import DTYPES, AttentionCase, case_ids, vary
from pagedbench.conformance.gate.harness import run_and_check

#: (num_heads, num_kv_heads): group 12 and group 16, with two KV heads and with one
LAYOUTS = ((24, 2), (32, 2), (12, 1), (16, 1))
DECODE = AttentionCase("decode", block_size=16, seq_lens=(97, 16, 1, 33), num_heads=24, num_kv_heads=2,
                       head_dim=32)
PREFILL = AttentionCase("prefill", block_size=16, seq_lens=(40, 16, 1, 33), q_lens=(40, 3, 1, 17), num_heads=24,
                        num_kv_heads=2, head_dim=32)


def _axes() -> list[AttentionCase]:
    cases = [vary(DECODE, num_heads=h, num_kv_heads=k) for h, k in LAYOUTS]
    cases += [vary(PREFILL, num_heads=h, num_kv_heads=k) for h, k in LAYOUTS[:2]]
    cases += [vary(DECODE, num_heads=32, dtype=d) for d in DTYPES if d != DECODE.dtype]
    cases += [vary(DECODE, block_size=5, seq_lens=(11, 4, 5)), vary(DECODE, num_heads=32, query="peaky")]
    cases += [vary(DECODE, seq_lens=(300, 7), num_splits=4), vary(PREFILL, num_heads=32, sliding_window=7)]
    return cases


def _full_grid() -> list[AttentionCase]:
    cases = []
    for b, (h, k), dt in itertools.product((1, 5, 16, 128), LAYOUTS, DTYPES):
        lens = (1, b, 2 * b + 1, 300)
        cases += [AttentionCase("decode", block_size=b, seq_lens=lens, num_heads=h, num_kv_heads=k, head_dim=128,
                                dtype=dt, query="peaky"),
                  AttentionCase("prefill", block_size=b, seq_lens=lens, q_lens=(1, b, 3, 17), num_heads=h,
                                num_kv_heads=k, head_dim=128, dtype=dt, query="peaky")]
    return cases


@pytest.mark.parametrize("case", _axes(), ids=case_ids(_axes()))
def test_large_gqa_group_matches_oracle(impl, case):
    run_and_check(impl, case, return_lse=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", _full_grid(), ids=case_ids(_full_grid()))
def test_large_gqa_group_full_grid(impl, case):
    run_and_check(impl, case)


SPIKES = [vary(DECODE, seq_lens=(37,), num_heads=h, num_kv_heads=k) for h, k in LAYOUTS[:2]]


@pytest.mark.parametrize("case", SPIKES, ids=case_ids(SPIKES))
def test_each_query_head_reads_its_kv_head(impl, case):
    """Key p dominates every query: head h's output must be V[p] of KV head h // group, for every h."""
    positions = [0, 5, 16, 36]
    case = vary(case, seq_lens=case.seq_lens * len(positions))
    x = builders.with_spikes(builders.build(case, impl.device), positions, seed=case.seed)
    out = builders.call(impl, case, x, out=builders.nan_out(len(positions), x.q))
    group = case.num_heads // case.num_kv_heads
    for s, p in enumerate(positions):
        v_p = x.v_cache[int(x.block_tables[s, p // case.block_size]), p % case.block_size].cpu().double()
        checks.check_case_tensor(out[s], v_p[torch.arange(case.num_heads) // group], case, what=f"spike@{p}")
