"""Adversarial inputs for a case: shuffled block tables, NaN everywhere a kernel must not read.

Layout of one built case (block_size 4, two sequences of 6 and 3 tokens, 2 spare blocks)::

    physical blocks   0    1    2    3    4    5       (a random order, never the identity; blocks 0
    seq 0 table      [5,   0,   p]                      and num_blocks-1 are always used)
    seq 1 table      [2,   p,   p]                      p: a poisoned spare block id (or -1, "garbage")
    k/v cache        every slot NaN except the positions < seq_len of each sequence

so any read of the tail of a last block, of an unreferenced block, or of a table entry past a sequence's
length puts NaN into the output. Outputs passed as ``out=`` are pre-filled with NaN too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from pagedbench.conformance import capabilities
from pagedbench.conformance.gate import oracle
from pagedbench.conformance.gate.cases import AttentionCase


@dataclass(frozen=True, slots=True)
class PagedInputs:
    """The tensors of one attention call (all on the implementation's device).

    q ``[num_queries, num_heads, head_dim]``; k_cache, v_cache
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; block_tables int32 ``[num_seqs, max_blocks]``;
    seq_lens int32 ``[num_seqs]``; cu_seqlens_q int32 ``[num_seqs + 1]`` (also built for decode).
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    scale: float


def block_order(num_blocks: int, needed: int, gen: torch.Generator) -> list[int]:
    """``needed`` distinct physical block ids in a random order that is not ``0, 1, 2, ...`` and
    contains block 0 and block ``num_blocks - 1`` whenever ``needed >= 2``."""
    while True:
        ids = torch.randperm(num_blocks, generator=gen)[:needed].tolist()
        if needed >= 2:
            for must in (0, num_blocks - 1):
                if must not in ids:
                    ids[int(torch.randint(needed, (1,), generator=gen))] = must
            if 0 not in ids or num_blocks - 1 not in ids:
                continue  # the second replacement overwrote the first; draw again
        if needed < 2 or ids != list(range(needed)):
            return ids


def build(case: AttentionCase, device: torch.device | str = "cpu") -> PagedInputs:
    """Fresh random inputs for ``case`` (seeded by ``case.seed``), poisoned as the module docstring says."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, d, dtype = case.block_size, case.num_kv_heads, case.head_dim, case.torch_dtype
    per_seq = [math.ceil(n / bs) for n in case.seq_lens]
    needed = sum(per_seq)
    num_blocks = needed + max(case.spare_blocks, 1)
    ids = block_order(num_blocks, needed, gen)
    spares = [b for b in range(num_blocks) if b not in set(ids)]
    width = max(per_seq) + 1
    tables = torch.empty(len(case.seq_lens), width, dtype=torch.int32)
    k_cache = torch.full((num_blocks, bs, hkv, d), math.nan, dtype=dtype)
    v_cache = torch.full_like(k_cache, math.nan)
    start = 0
    for s, (n, nb) in enumerate(zip(case.seq_lens, per_seq)):
        mine = ids[start : start + nb]
        start += nb
        pads = [-1 if case.pad == "garbage" else spares[(s + j) % len(spares)] for j in range(width - nb)]
        tables[s] = torch.tensor(mine + pads, dtype=torch.int32)
        for pos in range(n):  # only the logical positions of the sequence get values
            block, offset = mine[pos // bs], pos % bs
            k_cache[block, offset] = torch.randn(hkv, d, generator=gen).to(dtype)
            v_cache[block, offset] = torch.randn(hkv, d, generator=gen).to(dtype)
    q_lens = case.effective_q_lens
    q = torch.randn(sum(q_lens), case.num_heads, d, generator=gen)
    if case.query == "peaky":
        q = q * 8.0
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    dev = torch.device(device)
    return PagedInputs(
        q=q.to(dtype).to(dev), k_cache=k_cache.to(dev), v_cache=v_cache.to(dev),
        block_tables=tables.to(dev), seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=dev),
        cu_seqlens_q=cu.to(dev), scale=oracle.default_scale(d),
    )


def with_spikes(x: PagedInputs, positions: list[int], seed: int = 0) -> PagedInputs:
    """Make logical key ``positions[s]`` dominate every query of sequence ``s``.

    All query heads of sequence ``s`` become one vector ``u`` (``|u| = sqrt(head_dim)``, so ordinary
    scores have std 1) and the key at ``positions[s]`` becomes ``(48 / sqrt(head_dim)) * u`` in every KV
    head (score 48): the exact output is then ``V[positions[s]]`` of the query head's KV head, to within
    ``e^-40``.
    """
    gen = torch.Generator().manual_seed(seed)
    q, k_cache = x.q.clone(), x.k_cache.clone()
    d, bs = q.shape[-1], k_cache.shape[1]
    cu = x.cu_seqlens_q.tolist()
    for s, p in enumerate(positions):
        u = torch.randn(d, generator=gen, dtype=torch.float64)
        u = u / u.norm() * math.sqrt(d)
        q[cu[s] : cu[s + 1]] = u.to(q.dtype).to(q.device)
        block = int(x.block_tables[s, p // bs])
        k_cache[block, p % bs] = (u * (48.0 / math.sqrt(d))).to(k_cache.dtype).to(k_cache.device)
    return replace(x, q=q, k_cache=k_cache)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A NaN-filled buffer shaped like ``t`` (for ``out=``: proves every element gets written)."""
    return torch.full_like(t, math.nan)


def nan_out(num_rows: int, like: torch.Tensor) -> torch.Tensor:
    """A NaN-filled ``out`` buffer ``[num_rows, num_heads, head_dim]`` in ``like``'s dtype and device."""
    return torch.full((num_rows, *like.shape[1:]), math.nan, dtype=like.dtype, device=like.device)


def expected(case: AttentionCase, x: PagedInputs) -> oracle.OracleResult:
    """The float64 oracle's answer for ``x`` (computed on the CPU)."""
    args = (x.q.cpu(), x.k_cache.cpu(), x.v_cache.cpu(), x.block_tables.cpu(), x.seq_lens.cpu())
    if case.op == "decode":
        return oracle.decode(*args, scale=x.scale, sliding_window=case.sliding_window)
    return oracle.prefill(*args, x.cu_seqlens_q.cpu(), scale=x.scale, sliding_window=case.sliding_window)


def call(impl, case: AttentionCase, x: PagedInputs, **overrides):
    """Run ``case``'s operation on ``impl`` with ``x`` (keyword overrides: out=, return_lse=, ...).

    A case (or an LSE) the implementation does not declare is reported "not supported" (a skip)."""
    capabilities.require(impl, case, num_splits=overrides.get("num_splits"))
    if overrides.get("return_lse") and not impl.capabilities.returns_lse:
        pytest.skip(f"not supported: {impl.name} does not return LSE")
    kwargs = {"scale": x.scale, "sliding_window": case.sliding_window}
    if case.op == "decode":
        kwargs["num_splits"] = case.num_splits
        kwargs.update(overrides)
        return impl.paged_decode(x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens, **kwargs)
    kwargs.update(overrides)
    return impl.paged_prefill(x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens, x.cu_seqlens_q,
                              **kwargs)
