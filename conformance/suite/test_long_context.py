"""Large blocks (256 and 512 tokens) and long contexts (past 4,096 tokens, up to 32K), decode and short
query lengths (<= 256), against the float64 oracle.

The rest of the suite stops at blocks of 128 and about 3,000 tokens; kernels have been wrong only past
both (a block size above 128 past 4,096 tokens). The oracle of a full 32K prefill would need ~128 GiB,
so prefill here is a short chunk at the end of a long context, as chunked prefill and prefix hits make.
The cases in the fast run have one or two heads and head_dim 16 and stop at 16K tokens, so that they run
under Triton's CPU interpreter in seconds; the grid up to 32K with realistic heads is ``slow`` (and runs
in ``make gpu-check``).
"""

from __future__ import annotations

import itertools

import pytest
from pagedbench.conformance.gate.cases import DTYPES, AttentionCase, case_ids, vary
from pagedbench.conformance.gate.harness import run_and_check

LARGE_BLOCK_SIZES = (256, 512)
LONG_CONTEXTS = (4095, 4096, 4097, 8193, 16384, 32768)

DECODE = AttentionCase("decode", block_size=512, seq_lens=(16385, 511, 1), num_heads=2, num_kv_heads=1,
                       head_dim=16, dtype="fp32")
PREFILL = AttentionCase("prefill", block_size=512, seq_lens=(8193, 4097), q_lens=(256, 17), num_heads=2,
                        num_kv_heads=1, head_dim=16, dtype="fp32")


def _fast() -> list[AttentionCase]:
    return [
        DECODE,
        vary(DECODE, block_size=256, seq_lens=(8193, 257, 256, 255), dtype="fp16"),
        vary(DECODE, seq_lens=(8193, 513), num_splits=8, query="peaky"),
        PREFILL,
        vary(PREFILL, block_size=256, seq_lens=(4097, 600, 256), q_lens=(1, 256, 256), dtype="bf16"),
    ]


def _full_grid() -> list[AttentionCase]:
    cases = []
    for b, n, dt in itertools.product(LARGE_BLOCK_SIZES, LONG_CONTEXTS, DTYPES):
        decode = AttentionCase("decode", block_size=b, seq_lens=(n, b - 1, b + 1), num_heads=32, num_kv_heads=8,
                               head_dim=128, dtype=dt)
        cases += [decode, vary(decode, query="peaky"), vary(decode, seq_lens=(n,), num_splits=16)]
        cases += [AttentionCase("prefill", block_size=b, seq_lens=(n, b + 1), q_lens=(q, b + 1 if q > b else q),
                                num_heads=32, num_kv_heads=8, head_dim=128, dtype=dt) for q in (1, 17, 256)]
    return cases


@pytest.mark.parametrize("case", _fast(), ids=case_ids(_fast()))
def test_large_blocks_long_context_matches_oracle(impl, case):
    run_and_check(impl, case, return_lse=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", _full_grid(), ids=case_ids(_full_grid()))
def test_large_blocks_long_context_full_grid(impl, case):
    run_and_check(impl, case)
