"""Relations that must hold exactly (bit for bit) or between operations, whatever the numbers are.

* permuting the physical blocks (and the block tables with them) gives the identical output;
* a sequence alone or in a batch gives the identical output (split count pinned: a heuristic may pick
  different splits for different batches, which changes rounding legitimately);
* ``out=`` and the returned tensor are identical;
* decode ≡ prefill with one query; a prefill after a prefix hit ≡ the last rows of the full prefill;
  chunked prefill ≡ full prefill (within the dtype's bounds: different kernels may round differently);
* queries longer than the cache are rejected, or defined (positions < 0 see no key: output 0).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pagedbench.conformance import capabilities
from pagedbench.conformance.gate import builders, checks
from pagedbench.conformance.gate.cases import AttentionCase, case_ids, vary
from pagedbench.conformance.gate.harness import run_and_check

DECODE = AttentionCase("decode", block_size=5, seq_lens=(23, 1, 10, 41), num_heads=8, num_kv_heads=2)
PREFILL = AttentionCase("prefill", block_size=5, seq_lens=(23, 1, 10, 41), q_lens=(23, 1, 4, 7),
                        num_heads=8, num_kv_heads=2)
BOTH = [DECODE, vary(DECODE, dtype="bf16", sliding_window=6), PREFILL, vary(PREFILL, dtype="fp32")]


def _pinned(case: AttentionCase, **kw) -> dict:
    return {"num_splits": 1, **kw} if case.op == "decode" else kw


def permute_blocks(x: builders.PagedInputs, perm: torch.Tensor) -> builders.PagedInputs:
    """Physical block b moves to perm[b]; tables follow (entries -1 stay -1)."""
    k, v = torch.empty_like(x.k_cache), torch.empty_like(x.v_cache)
    dev_perm = perm.to(x.k_cache.device)
    k[dev_perm], v[dev_perm] = x.k_cache, x.v_cache
    tables = x.block_tables.long()
    moved = torch.where(tables >= 0, perm.to(tables.device)[tables.clamp_min(0)], tables)
    return replace(x, k_cache=k, v_cache=v, block_tables=moved.to(torch.int32))


@pytest.mark.parametrize("case", BOTH, ids=case_ids(BOTH))
def test_permuting_physical_blocks_is_bit_exact(impl, case):
    x = builders.build(case, impl.device)
    first = run_and_check(impl, case, x=x, **_pinned(case))
    gen = torch.Generator().manual_seed(case.seed)
    for _ in range(2):
        perm = torch.randperm(x.k_cache.shape[0], generator=gen)
        again = builders.call(impl, case, permute_blocks(x, perm), **_pinned(case))
        checks.assert_bitwise_equal(again, first, what=f"after permutation {perm.tolist()}", context=case.id)


@pytest.mark.parametrize("case", BOTH, ids=case_ids(BOTH))
def test_alone_or_in_a_batch_is_bit_exact(impl, case):
    x = builders.build(case, impl.device)
    batch = run_and_check(impl, case, x=x, **_pinned(case))  # right, not merely self-consistent
    cu = x.cu_seqlens_q.tolist()
    for s in range(len(case.seq_lens)):
        rows = slice(cu[s], cu[s + 1])
        alone = replace(x, q=x.q[rows].contiguous(), block_tables=x.block_tables[s : s + 1].contiguous(),
                        seq_lens=x.seq_lens[s : s + 1].contiguous(),
                        cu_seqlens_q=torch.tensor([0, cu[s + 1] - cu[s]], dtype=torch.int32,
                                                  device=x.q.device))
        single = vary(case, seq_lens=case.seq_lens[s : s + 1],
                      q_lens=None if case.q_lens is None else case.q_lens[s : s + 1])
        out = builders.call(impl, single, alone, **_pinned(case))
        if impl.capabilities.batch_invariant:
            checks.assert_bitwise_equal(out, batch[rows], what=f"sequence {s} alone vs in the batch",
                                        context=case.id)
        else:  # not claimed bit for bit: within the dtype's bounds
            capabilities.note_unchecked("batch-invariance")
            checks.check_case_tensor(out, batch[rows].cpu().to(torch.float64), case,
                                     what=f"sequence {s} alone vs in the batch")


@pytest.mark.parametrize("case", BOTH, ids=case_ids(BOTH))
def test_out_buffer_and_returned_tensor_are_identical(impl, case):
    x = builders.build(case, impl.device)
    with_lse = impl.capabilities.returns_lse
    if not with_lse:
        capabilities.note_unchecked("lse")
    first = builders.call(impl, case, x, return_lse=with_lse, **_pinned(case))
    checks.check_attention(first, builders.expected(case, x), case.torch_dtype, case.tolerance,
                           context=case.id, return_lse=with_lse)  # right, not merely self-consistent
    returned, lse = checks.split_result(first, with_lse)
    out = builders.nan_out(x.q.shape[0], x.q)
    result, lse_out = checks.split_result(
        builders.call(impl, case, x, out=out, return_lse=with_lse, **_pinned(case)), with_lse)
    checks.assert_bitwise_equal(out, returned, what="out= buffer vs returned tensor", context=case.id)
    checks.assert_bitwise_equal(result, returned, what="tensor returned with out= vs without",
                                context=case.id)
    if with_lse:
        checks.assert_bitwise_equal(lse_out, lse, what="lse with out= vs without", context=case.id)


DP_CASES = [DECODE, vary(DECODE, block_size=16, seq_lens=(1, 16, 17, 97), dtype="fp32"),
            vary(DECODE, sliding_window=4)]


@pytest.mark.parametrize("case", DP_CASES, ids=case_ids(DP_CASES))
def test_decode_equals_prefill_with_one_query(impl, case):
    x = builders.build(case, impl.device)
    decode = run_and_check(impl, case, x=x, return_lse=True)
    as_prefill = vary(case, op="prefill", q_lens=tuple(1 for _ in case.seq_lens))
    prefill = run_and_check(impl, as_prefill, x=x, return_lse=True)
    checks.check_case_tensor(prefill, decode.cpu().to(torch.float64), case, what="prefill_vs_decode")


FULL = AttentionCase("prefill", block_size=5, seq_lens=(37, 12), num_heads=8, num_kv_heads=2)


@pytest.mark.parametrize("case", [FULL, vary(FULL, sliding_window=9, dtype="bf16")], ids=case_ids(
    [FULL, vary(FULL, sliding_window=9, dtype="bf16")]))
def test_prefix_hit_and_chunks_equal_full_prefill(impl, case):
    """Prefill of the last m tokens after a prefix hit gives the last m rows of the full prefill; a
    prefill split into chunks (each chunk seeing the cache up to its end) gives all of them."""
    x = builders.build(case, impl.device)
    full = run_and_check(impl, case, x=x)
    lens, cu = case.seq_lens, x.cu_seqlens_q.tolist()
    for hit in (1, 5, 11):  # tokens served from the prefix cache (block edge and not)
        tail = vary(case, q_lens=tuple(n - hit for n in lens))
        rows = torch.cat([torch.arange(cu[s] + hit, cu[s + 1]) for s in range(len(lens))]).to(x.q.device)
        hit_x = replace(x, q=x.q[rows], cu_seqlens_q=_cu([n - hit for n in lens], x.q.device))
        got = run_and_check(impl, tail, x=hit_x)
        checks.check_case_tensor(got, full[rows].cpu().to(torch.float64), case, what=f"prefix_hit={hit}")
    for start, end in ((0, 10), (10, 11), (11, 25)):  # chunk of sequence 0: tokens start..end-1
        chunk = vary(case, seq_lens=(end,), q_lens=(end - start,))
        chunk_x = replace(x, q=x.q[start:end], block_tables=x.block_tables[:1],
                          seq_lens=torch.tensor([end], dtype=torch.int32, device=x.q.device),
                          cu_seqlens_q=_cu([end - start], x.q.device))
        got = run_and_check(impl, chunk, x=chunk_x)
        checks.check_case_tensor(got, full[start:end].cpu().to(torch.float64), case,
                                 what=f"chunk {start}:{end}")


def _cu(q_lens: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    return cu.to(device)


def test_queries_longer_than_the_cache_are_rejected_or_defined(impl):
    """q_len > seq_len: a ValueError, or the defined answer (the extra queries sit at positions < 0,
    see no key, and get output 0; the others match the oracle)."""
    case = AttentionCase("prefill", block_size=5, seq_lens=(6, 3), q_lens=(6, 3))
    x = builders.build(case, impl.device)
    longer = replace(x, q=torch.cat([x.q[:1], x.q]), cu_seqlens_q=_cu([7, 3], x.q.device))
    try:
        out = builders.call(impl, vary(case, q_lens=(7, 3)), longer, out=builders.nan_out(10, x.q))
    except ValueError as e:
        assert "cu_seqlens_q" in str(e) or "query" in str(e), f"unclear rejection: {e}"
        return
    ref = builders.expected(case, x)
    checks.check_case_tensor(out[1:], ref.out, case, what="rows at valid positions")
    checks.check_tensor(out[:1], torch.zeros(1, *x.q.shape[1:], dtype=torch.float64), case.torch_dtype,
                        rel=0.0, max_abs=0.0, what="row at position -1", context=case.id)
