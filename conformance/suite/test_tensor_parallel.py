"""Sharded KV heads (tensor parallelism): the call of every rank on its own heads, the ranks' outputs put
back together along heads, against the float64 oracle over the unsharded call.

Rank ``r`` of ``N`` holds query heads ``[r*H/N, (r+1)*H/N)`` and KV heads ``[r*Hkv/N, (r+1)*Hkv/N)``
(``gate/shards.py``: a dense copy per rank, as each rank's own pool is, or a view into one cache holding
every head), with the block tables, lengths and slot mapping of the whole batch. Local query head ``h``
must read local KV head ``h // group``; an implementation that numbers a shard's KV heads globally (from
the first head of the model, or of the slot in a shared cache) is right on rank 0 and reads another
rank's heads, or past its own, everywhere else. The layouts are GQA groups of 4 (8 query heads, 2 KV
heads) and 2 (8 / 4) and MHA (8 / 8), over 2 and 4 ranks where the KV heads divide; the paths a decode,
a first prompt's prefill, a chunk over a cached prefix, and a step in which each rank writes the chunk's
K/V into its shard with ``write_kv`` and then attends over it. A shard view may be refused only clearly
(``gate/refusal.py``); every rank's rows are judged on their own, so a failure names the rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedbench.conformance import capabilities
from pagedbench.conformance.gate import builders, checks, shards
from pagedbench.conformance.gate.cases import AttentionCase, vary
from pagedbench.conformance.gate.oracle import OracleResult
from pagedbench.conformance.gate.refusal import call_or_refused

NUM_HEADS = 8
SHARDINGS = [shards.Sharding(NUM_HEADS, kv, n) for kv in (2, 4, 8) for n in (2, 4) if kv % n == 0]
#: blocks of 16 and fp16, which every peer adapter takes (vLLM's kernels want blocks of 16k, some fp16 or bf16)
DECODE = AttentionCase("decode", block_size=16, seq_lens=(21, 3, 40), num_heads=NUM_HEADS, num_kv_heads=2,
                       head_dim=32, dtype="fp16", query="peaky")
FIRST_PROMPT = vary(DECODE, op="prefill", seq_lens=(13, 3, 9))
CACHED_PREFIX = vary(DECODE, op="prefill", q_lens=(5, 1, 9))


def _cases() -> list[tuple[AttentionCase, shards.Sharding, str]]:
    return [(vary(case, num_kv_heads=s.num_kv_heads), s, pool)
            for case in (DECODE, FIRST_PROMPT, CACHED_PREFIX) for s in SHARDINGS for pool in shards.POOLS]


CASES = _cases()
STEPS = [(vary(CACHED_PREFIX, num_kv_heads=s.num_kv_heads), s, pool) for s in SHARDINGS for pool in shards.POOLS]


def _ids(cases) -> list[str]:
    return [f"{c.id},{s.id},{pool}" for c, s, pool in cases]


def _rank_case(case: AttentionCase, sharding: shards.Sharding) -> AttentionCase:
    return vary(case, num_heads=sharding.heads_per_rank, num_kv_heads=sharding.kv_heads_per_rank)


def attend_on_every_rank(impl, case: AttentionCase, sharding: shards.Sharding, x: builders.PagedInputs,
                         caches: list[tuple[torch.Tensor, torch.Tensor]], ref: OracleResult, context: str) -> None:
    """Each rank's call on its query heads and its ``caches[rank]``, judged rank by rank against the
    oracle's heads of that rank (out, ``out=`` and LSE where returned), then all ranks' outputs put back
    together along heads against the whole oracle."""
    return_lse = impl.capabilities.returns_lse
    if not return_lse:
        capabilities.note_unchecked("lse")
    rank_case, tol, outs = _rank_case(case, sharding), case.tolerance, []
    for rank, (k_cache, v_cache) in enumerate(caches):
        heads = sharding.q_heads(rank)
        x_r = builders.PagedInputs(x.q[:, heads].contiguous(), k_cache, v_cache, x.block_tables, x.seq_lens,
                                   x.cu_seqlens_q, x.scale)
        out = builders.nan_out(x_r.q.shape[0], x_r.q)
        where = f"{context},rank {rank} of {sharding.world_size}"
        result = call_or_refused(where,
                                 lambda x_r=x_r, out=out: builders.call(impl, rank_case, x_r, out=out,
                                                                        return_lse=return_lse))
        got = checks.check_attention(result, OracleResult(ref.out[:, heads], ref.lse[:, heads]), case.torch_dtype,
                                     tol, context=where, return_lse=return_lse)
        checks.check_tensor(out, ref.out[:, heads], case.torch_dtype, rel=tol.rel, max_abs=tol.max_abs,
                            what="out_buffer", context=where)
        outs.append(got)
    checks.check_tensor(torch.cat(outs, dim=1), ref.out, case.torch_dtype, rel=tol.rel, max_abs=tol.max_abs,
                        what="out of every rank along heads", context=context)


@pytest.mark.parametrize("case,sharding,pool", CASES, ids=_ids(CASES))
def test_every_rank_attends_its_own_heads(impl, case, sharding, pool):
    """Every rank's rows on its shard equal the oracle's rows of its heads, and the ranks' outputs
    together equal the unsharded oracle."""
    capabilities.require(impl, _rank_case(case, sharding))
    x = builders.build(case, impl.device)
    caches = [(shards.shard_cache(x.k_cache, sharding, r, pool), shards.shard_cache(x.v_cache, sharding, r, pool))
              for r in range(sharding.world_size)]
    attend_on_every_rank(impl, case, sharding, x, caches, builders.expected(case, x), f"{case.id},{sharding.id},{pool}")


def _chunk_slots(x: builders.PagedInputs) -> torch.Tensor:
    """The slots of every sequence's query positions (its last ``q_len`` ones), in query order."""
    bs, cu, slots = x.k_cache.shape[1], x.cu_seqlens_q.tolist(), []
    for s, n in enumerate(x.seq_lens.tolist()):
        for p in range(n - (cu[s + 1] - cu[s]), n):
            slots.append(int(x.block_tables[s, p // bs]) * bs + p % bs)
    return torch.tensor(slots, dtype=torch.int64, device=x.k_cache.device)


def _write_rank(impl, sharding, rank, new, caches, slots, context) -> bool:
    """Rank ``rank``'s ``write_kv`` of its heads of ``new`` (K and V ``[T, Hkv, D]``) into ``caches``; where
    the implementation has none or refuses the view clearly, the suite writes them (after checking that
    the refusal changed nothing) and the write is left unchecked. Whether the implementation wrote."""
    heads = sharding.kv_heads(rank)
    k, v = (t[:, heads].contiguous() for t in new)
    before = [c.clone() for c in caches]
    try:
        call_or_refused(context, lambda: impl.write_kv(k, v, *caches, slots))
    except pytest.skip.Exception:
        for c, b, name in zip(caches, before, ("k_cache", "v_cache")):
            checks.assert_bitwise_equal(c, b, what=f"{name} after a refused write_kv", context=context)
        capabilities.note_unchecked("write_kv")
        for c, t in zip(caches, (k, v)):
            c.view(-1, *c.shape[2:])[slots] = t  # a view of a view: the shard's own slots
        return False
    return True


@pytest.mark.parametrize("case,sharding,pool", STEPS, ids=_ids(STEPS))
def test_a_step_on_every_rank(impl, case, sharding, pool):
    """A chunk over a cached prefix as each rank runs it: the chunk's K/V heads written into the rank's
    shard by its ``write_kv`` (the same slot mapping on every rank), which must then hold exactly what
    the unsharded cache holds in its heads (and, in a shared cache, leave the other ranks' heads alone),
    then the chunk's attention over the shard, judged as in the test above. An implementation with one
    of the two is judged on it (the other left unchecked); with neither, the step is not supported."""
    capabilities.require(impl, _rank_case(case, sharding))
    x = builders.build(case, impl.device)
    slots = _chunk_slots(x)
    new = [c.view(-1, *c.shape[2:])[slots].clone() for c in (x.k_cache, x.v_cache)]
    whole = [c.clone() for c in (x.k_cache, x.v_cache)]  # the shared cache, with the chunk's slots unwritten
    for c in whole:
        c.view(-1, *c.shape[2:])[slots] = math.nan
    context = f"{case.id},{sharding.id},{pool}"
    pristine, caches, wrote = [c.clone() for c in whole], [], False
    for rank in range(sharding.world_size):
        mine = [shards.shard_cache(c, sharding, rank, pool) for c in whole]
        where = f"{context},write_kv on rank {rank} of {sharding.world_size}"
        wrote |= _write_rank(impl, sharding, rank, new, mine, slots, where)
        heads = sharding.kv_heads(rank)
        for got, want, name in zip(mine, (x.k_cache, x.v_cache), ("k_cache", "v_cache")):
            checks.assert_bitwise_equal(got, want[:, :, heads], what=f"{name} of the rank", context=where)
        for got, before, t, name in zip(whole, pristine, new, ("k_cache", "v_cache")):
            want = before.clone()  # a shared cache: the heads of the ranks so far written; an own pool: nothing
            if pool == "shared-cache":
                want.view(-1, *want.shape[2:])[slots, : heads.stop] = t[:, : heads.stop]
            checks.assert_bitwise_equal(got, want, what=f"the whole {name} (every rank's heads)", context=where)
        caches.append(tuple(mine))
    try:
        attend_on_every_rank(impl, case, sharding, x, caches, builders.expected(case, x), context)
    except pytest.skip.Exception:
        if not wrote:
            raise
        capabilities.note_unchecked("attention")  # its writes were judged, and passed
