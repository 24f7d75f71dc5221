"""Every batch index judged: one sequence unlike the others, moved from the first index to the last.

A kernel can be right for batch index 0 alone (an offset that is 0 there, a length or plan read from the
first sequence, a uniformity test of part of the batch); a batch whose sequences all differ hides it
when the first sequence happens to be the longest. Here three sequences share one shape and the odd one
(longer, shorter than one block, or with another query length) sits at index 0, in the middle and at the
last index; every sequence's rows are compared to the float64 oracle on their own, so a failure names the
batch index it is at.
"""

from __future__ import annotations

import pytest
from pagedbench.conformance import capabilities
from pagedbench.conformance.gate import builders, checks
from pagedbench.conformance.gate.cases import AttentionCase
from pagedbench.conformance.gate.oracle import OracleResult

NUM_SEQS = 4
POSITIONS = (0, 1, NUM_SEQS - 1)  # first, an inner one, last
BLOCK_SIZE = 8
#: the shape the other sequences share: (seq_len, q_len); 21 keys end inside their third block
COMMON = (21, 5)
#: the odd sequence: (name, seq_len, q_len)
ODD = (
    ("longer", 61, 9),  # eight blocks where the others have three
    ("shorter-than-a-block", 3, 3),
    ("same-keys-more-queries", 21, 17),  # prefill only: the same context, another query length
)


def _case(op: str, odd: tuple[str, int, int], position: int) -> AttentionCase:
    _, odd_len, odd_q = odd
    seq_lens = tuple(odd_len if s == position else COMMON[0] for s in range(NUM_SEQS))
    q_lens = tuple(odd_q if s == position else COMMON[1] for s in range(NUM_SEQS)) if op == "prefill" else None
    return AttentionCase(op, block_size=BLOCK_SIZE, seq_lens=seq_lens, q_lens=q_lens, num_heads=4, num_kv_heads=2,
                         head_dim=32, dtype="fp32", query="peaky")


CASES = [
    (_case(op, odd, pos), pos)
    for op in ("decode", "prefill")
    for odd in ODD
    if not (op == "decode" and odd[1] == COMMON[0])  # decode has one query per sequence: no odd q_len
    for pos in POSITIONS
]


def check_every_row(out, ref: OracleResult, case: AttentionCase, cu: list[int], *, what: str) -> None:
    """Each sequence's rows ``cu[s]:cu[s+1]`` against the oracle's, so the message names the batch index."""
    tol = case.tolerance
    for s in range(len(cu) - 1):
        rows = slice(cu[s], cu[s + 1])
        checks.check_tensor(out[rows], ref.out[rows], case.torch_dtype, rel=tol.rel, max_abs=tol.max_abs,
                            what=what, context=f"{case.id},batch index {s} of {len(cu) - 1}")


@pytest.mark.parametrize("case,position", CASES, ids=[f"{c.id},odd@{p}" for c, p in CASES])
def test_every_batch_index_matches_the_oracle(impl, case, position):
    """The odd sequence at ``position`` and each of the others: their rows (and the caller's ``out=``) equal
    the oracle's, whatever index the odd one has."""
    capabilities.require(impl, case)
    x = builders.build(case, impl.device)
    out = builders.nan_out(x.q.shape[0], x.q)
    result = builders.call(impl, case, x, out=out)
    ref = builders.expected(case, x)
    got, _ = checks.split_result(result, False)
    cu = x.cu_seqlens_q.tolist()
    check_every_row(got, ref, case, cu, what="out")
    check_every_row(out, ref, case, cu, what="out_buffer")
