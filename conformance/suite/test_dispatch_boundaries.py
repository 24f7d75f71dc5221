"""The paths an implementation's own dispatch rules choose, reached from both sides of each rule's switch.

A kernel can be wrong only for the sizes a rule sends to it (a split-K path from some batch size, a
tensor-core path from some GQA group). An implementation declares where its rules switch in
``Capabilities.dispatch_boundaries`` (:class:`~pagedbench.conformance.capabilities.DispatchBoundaries`);
for each declared boundary N this family runs cases at N-1, N and N+1 (numbers of sequences for decode,
sequence lengths for decode and prefill, GQA groups for decode, the longest query chunk for prefill), with
the implementation's own dispatch
(``num_splits`` None), each against the float64 oracle. Nothing declared: "not supported".
"""

from __future__ import annotations

import pytest
from pagedbench.conformance.gate.cases import AttentionCase
from pagedbench.conformance.gate.harness import run_and_check

KINDS = ("decode_batch_sizes", "context_lens", "gqa_groups", "query_lens")
LENGTHS = (37, 5, 130, 1, 64, 300, 17)  # the sequences of a batch, cycled: long and short, one of 1 key


def cases_around(kind: str, boundary: int) -> list[AttentionCase]:
    """The cases at ``boundary`` - 1, ``boundary`` and ``boundary`` + 1 for one kind of rule."""
    out = []
    for n in (boundary - 1, boundary, boundary + 1):
        if n < 1:
            continue
        if kind == "decode_batch_sizes":
            out.append(AttentionCase("decode", block_size=16, seq_lens=tuple(LENGTHS[i % len(LENGTHS)]
                                                                              for i in range(n))))
        elif kind == "context_lens":
            out.append(AttentionCase("decode", block_size=16, seq_lens=(n, 3)))
            out.append(AttentionCase("prefill", block_size=16, seq_lens=(n, 3), q_lens=(min(n, 5), 3)))
        elif kind == "gqa_groups":
            out.append(AttentionCase("decode", block_size=16, seq_lens=(97, 16, 1), num_heads=2 * n,
                                     num_kv_heads=2, head_dim=32))
        else:  # the longest chunk is n queries, after a context; beside a decode row and a whole short prompt
            out.append(AttentionCase("prefill", block_size=16, seq_lens=(n + 40, 7, 3), q_lens=(n, 1, 3)))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_both_sides_of_each_declared_switch_match_the_oracle(impl, kind):
    declared = impl.capabilities.dispatch_boundaries
    boundaries = getattr(declared, kind, ()) if declared is not None else ()
    if not boundaries:
        pytest.skip(f"not supported: {impl.name} declares no {kind} in Capabilities.dispatch_boundaries")
    for boundary in boundaries:
        for case in cases_around(kind, boundary):
            run_and_check(impl, case, return_lse=True)
