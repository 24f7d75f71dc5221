"""Batch invariance with different neighbours, under the implementation's own dispatch.

A sequence's rows must be bit-identical whoever its neighbours are: alone, beside a much longer sequence
(a wider block table, a longer context: what a split-K or tile rule keys on), and among many short ones
(more sequences: what an occupancy rule keys on). Unlike the metamorphic family's "alone or in a batch"
(split count pinned to 1), nothing is pinned here: ``num_splits`` stays None, so a launcher that picks
its splits or tiles by the batch fails. Only implementations that declare
``Capabilities.batch_invariant_dispatch`` are held to it; for the others every case is "not supported".
The full batch is first checked against the float64 oracle, so the rows compared are right, not merely
self-consistent.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from pagedbench.conformance.gate import builders, checks
from pagedbench.conformance.gate.cases import AttentionCase, case_ids, vary
from pagedbench.conformance.gate.harness import run_and_check

#: index 0 the longest sequence; 1 (and 3) judged; the rest short neighbours
DECODE = AttentionCase("decode", block_size=4, seq_lens=(301, 9, 3, 30, 1, 17), num_heads=8, num_kv_heads=2)
PREFILL = AttentionCase("prefill", block_size=4, seq_lens=(301, 9, 3, 30, 1, 17), q_lens=(40, 9, 2, 5, 1, 3),
                        num_heads=8, num_kv_heads=2)
#: one KV head and a judged sequence of 600 keys: alone it is one program, which an occupancy rule splits
LONE = AttentionCase("decode", block_size=16, seq_lens=(700, 600, 20, 5), num_heads=4, num_kv_heads=1, dtype="fp32")
CASES = [DECODE, vary(DECODE, dtype="fp32"), PREFILL, LONE]


def sub_batch(case: AttentionCase, x: builders.PagedInputs, rows: list[int]) -> tuple[AttentionCase,
                                                                                      builders.PagedInputs]:
    """Sequences ``rows`` of ``x`` as a batch of their own, their tables cut to the columns they use."""
    bs = case.block_size
    width = max(math.ceil(case.seq_lens[r] / bs) for r in rows)
    cu = x.cu_seqlens_q.tolist()
    q = torch.cat([x.q[cu[r]:cu[r + 1]] for r in rows])
    q_lens = [cu[r + 1] - cu[r] for r in rows]
    cu_new = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu_new[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    dev = x.q.device
    y = replace(x, q=q.contiguous(), block_tables=x.block_tables[rows, :width].contiguous(),
                seq_lens=x.seq_lens[rows].contiguous(), cu_seqlens_q=cu_new.to(dev))
    sub = vary(case, seq_lens=tuple(case.seq_lens[r] for r in rows),
               q_lens=None if case.q_lens is None else tuple(case.q_lens[r] for r in rows))
    return sub, y


@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_rows_do_not_depend_on_the_neighbours(impl, case):
    if not impl.capabilities.batch_invariant_dispatch:
        pytest.skip(f"not supported: {impl.name} does not declare batch_invariant_dispatch")
    x = builders.build(case, impl.device)
    full = run_and_check(impl, case, x=x)  # right, not merely self-consistent
    cu = x.cu_seqlens_q.tolist()
    judged = (1,) if len(case.seq_lens) < 6 else (1, 3)
    shorts = [r for r in range(len(case.seq_lens)) if r not in (0, *judged)]
    for s in judged:
        for label, rows in (("alone", [s]), ("beside the longest", [0, s]),
                            ("among the short ones", [*shorts, s])):
            sub, y = sub_batch(case, x, rows)
            out = builders.call(impl, sub, y)
            mine = rows.index(s)
            ycu = y.cu_seqlens_q.tolist()
            checks.assert_bitwise_equal(out[ycu[mine]:ycu[mine + 1]], full[cu[s]:cu[s + 1]],
                                        what=f"sequence {s} {label} vs in the whole batch", context=case.id)
