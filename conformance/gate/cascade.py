"""Cases of the attention-state merge: direct merges of random parts, and cascade (shared-prefix) layouts.

Cascade attention computes a prefix shared by many sequences once, for all of their queries, and merges
it with each sequence's attention over its own suffix through the natural-log LSE::

    physical blocks    [ P0 | P1 ]  [ A0 | A1 ]  [ B0 ]         P: the shared prefix's blocks (full)
    full table of a    P0 P1 A0 A1                              what plain paged attention reads
    full table of b    P0 P1 B0
    prefix part        every query of a and b over P0 P1         (no causal mask: the prefix precedes them)
    suffix part        a's queries over A0 A1, b's over B0       (causal within the suffix)
    merge_attn_states(prefix part, suffix part) == attention over the full table

The float64 oracle here is the merge formula itself (:func:`merge`), and ``conformance.gate.oracle`` over the
full tables for the cascade. As everywhere in the suite, caches are NaN except the slots in use, block
ids are shuffled, and a part with LSE ``-inf`` holds NaN (a merge must not read it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from pagedbench.conformance.gate import builders, oracle
from pagedbench.conformance.gate.cases import SeededCase, Tolerance

#: kinds of LSE pair of a direct merge case
LSE_KINDS = ("randn", "far", "huge-out", "empty-a", "empty-both", "mixed-inf")


@dataclass(frozen=True, slots=True)
class MergeCase(SeededCase):
    """One direct merge: two random parts of ``num_tokens`` x ``num_heads`` rows with LSEs of ``lse`` kind.

    ``randn``: LSEs ~ 3·N(0, 1) around 0 ... ``far``: the parts' LSEs 600 apart in magnitude and 25 apart
    from each other (one weight e^-25: below float32's epsilon next to 1); ``huge-out``: part B's outputs
    ×1e4 with an LSE 8 below A's, so the small weight still moves the result; ``empty-a``: part A has no
    key (LSE -inf, outputs NaN); ``empty-both``: neither has (result 0, LSE -inf); ``mixed-inf``: each
    row one of the four (both finite, A empty, B empty, both empty).
    """

    num_tokens: int
    num_heads: int = 4
    head_dim: int = 32
    dtype: str = "fp16"
    lse: str = "randn"

    @property
    def id(self) -> str:
        return (f"merge/t={self.num_tokens},h={self.num_heads},d={self.head_dim},{self.dtype}"
                + ("" if self.lse == "randn" else f",{self.lse}"))



@dataclass(frozen=True, slots=True)
class MergeInputs:
    """out_a, out_b ``[num_tokens, num_heads, head_dim]`` (the case's dtype); lse_a, lse_b float32
    ``[num_tokens, num_heads]``."""

    out_a: torch.Tensor
    lse_a: torch.Tensor
    out_b: torch.Tensor
    lse_b: torch.Tensor


def _lse_pair(case: MergeCase, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (case.num_tokens, case.num_heads)
    lse_a, lse_b = 3 * torch.randn(shape, generator=gen), 3 * torch.randn(shape, generator=gen)
    if case.lse == "far":
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        lse_a = 600.0 * sign + lse_a
        lse_b = lse_a - 25.0 * sign
    elif case.lse == "huge-out":
        lse_b = lse_a - 8.0
    elif case.lse == "empty-a":
        lse_a = torch.full(shape, -math.inf)
    elif case.lse == "empty-both":
        lse_a, lse_b = torch.full(shape, -math.inf), torch.full(shape, -math.inf)
    elif case.lse == "mixed-inf":
        which = torch.arange(case.num_tokens * case.num_heads).reshape(shape) % 4
        lse_a = torch.where((which == 1) | (which == 3), -math.inf, lse_a)
        lse_b = torch.where((which == 2) | (which == 3), -math.inf, lse_b)
    return lse_a, lse_b


def build_merge(case: MergeCase, device: torch.device | str = "cpu") -> MergeInputs:
    """Fresh random parts for ``case`` (seeded by its id); the outputs of a part with no key are NaN."""
    gen = torch.Generator().manual_seed(case.seed)
    shape = (case.num_tokens, case.num_heads, case.head_dim)
    out_a, out_b = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    lse_a, lse_b = _lse_pair(case, gen)
    if case.lse == "huge-out":
        out_b = out_b * 1e4
    out_a = torch.where(torch.isinf(lse_a)[..., None], math.nan, out_a)
    out_b = torch.where(torch.isinf(lse_b)[..., None], math.nan, out_b)
    dev, dt = torch.device(device), case.torch_dtype
    return MergeInputs(out_a.to(dt).to(dev), lse_a.to(dev), out_b.to(dt).to(dev), lse_b.to(dev))


def merge(out_a, lse_a, out_b, lse_b) -> oracle.OracleResult:
    """The exact merge, in float64 on the CPU: ``lse = logaddexp(lse_a, lse_b)``, each part weighted by
    ``exp(lse_part - lse)``; a part with LSE -inf is not read; both -inf give 0 and -inf."""
    la, lb = lse_a.cpu().to(torch.float64), lse_b.cpu().to(torch.float64)
    lse = torch.logaddexp(la, lb)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    parts = []
    for o, part_lse in ((out_a, la), (out_b, lb)):
        w = torch.where(torch.isinf(part_lse) | torch.isinf(lse), 0.0, torch.exp(part_lse - safe))[..., None]
        parts.append(torch.where(w > 0, o.cpu().to(torch.float64), 0.0) * w)
    return oracle.OracleResult(parts[0] + parts[1], lse)


def lse_bound(tol: Tolerance, ref_lse: torch.Tensor) -> float:
    """The merged LSE's bound: the table's ``lse_abs`` plus float32's half ulp at the largest |LSE| (an LSE
    of 600 is held to 3e-5 at best in float32, whatever the merge does)."""
    finite = ref_lse[torch.isfinite(ref_lse)]
    top = float(finite.abs().max()) if finite.numel() else 0.0
    return tol.lse_abs + top * 2.0 ** -24


@dataclass(frozen=True, slots=True)
class CascadeCase(SeededCase):
    """Sequences sharing a prefix of ``prefix_len`` tokens (whole blocks) then ``suffix_lens[s]`` of their
    own; sequence s's queries are its last ``q_lens[s]`` tokens (all in its suffix)."""

    block_size: int
    prefix_len: int
    suffix_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "fp32"
    query: str = "randn"  # or "peaky" (queries x8: one part may dominate)

    def __post_init__(self) -> None:
        if self.prefix_len % self.block_size:
            raise ValueError(f"prefix_len must be whole blocks of {self.block_size}; got {self.prefix_len}")
        if any(q > n for q, n in zip(self.q_lens, self.suffix_lens)):
            raise ValueError(f"q_lens {self.q_lens} must fit in suffix_lens {self.suffix_lens}")

    @property
    def id(self) -> str:
        join = "+".join
        return (f"cascade/bs={self.block_size},prefix={self.prefix_len},suffix={join(map(str, self.suffix_lens))},"
                f"q={join(map(str, self.q_lens))},hq={self.num_heads},hkv={self.num_kv_heads},d={self.head_dim},"
                f"{self.dtype}" + ("" if self.query == "randn" else f",{self.query}"))



@dataclass(frozen=True, slots=True)
class CascadeInputs:
    """One cascade layout. q ``[total_q, num_heads, head_dim]``; caches as every paged case; int32
    ``full_tables`` / ``suffix_tables`` ``[num_seqs, width]`` with ``full_lens`` / ``suffix_lens``; the
    prefix part's ``prefix_tables`` ``[total_q, width]`` (every row the prefix's blocks) with
    ``prefix_lens`` (all prefix_len); ``cu_seqlens_q`` ``[num_seqs + 1]``."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    full_tables: torch.Tensor
    full_lens: torch.Tensor
    suffix_tables: torch.Tensor
    suffix_lens: torch.Tensor
    prefix_tables: torch.Tensor
    prefix_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    scale: float


def build_cascade(case: CascadeCase, device: torch.device | str = "cpu") -> CascadeInputs:
    """Fresh random K/V and queries for ``case`` (seeded by its id) in shuffled, NaN-poisoned blocks."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, d, dt = case.block_size, case.num_kv_heads, case.head_dim, case.torch_dtype
    num_prefix = case.prefix_len // bs
    per_seq = [math.ceil(n / bs) for n in case.suffix_lens]
    needed = num_prefix + sum(per_seq)
    num_blocks = needed + 2
    ids = builders.block_order(num_blocks, needed, gen)
    spare = next(b for b in range(num_blocks) if b not in set(ids))
    k_cache = torch.full((num_blocks, bs, hkv, d), math.nan, dtype=dt)
    v_cache = torch.full_like(k_cache, math.nan)

    def fill(blocks: list[int], n: int) -> None:
        for pos in range(n):
            k_cache[blocks[pos // bs], pos % bs] = torch.randn(hkv, d, generator=gen).to(dt)
            v_cache[blocks[pos // bs], pos % bs] = torch.randn(hkv, d, generator=gen).to(dt)

    prefix = ids[:num_prefix]
    fill(prefix, case.prefix_len)
    width = num_prefix + max(per_seq, default=0) + 1
    full, suffix, start = [], [], num_prefix
    for n, nb in zip(case.suffix_lens, per_seq):
        own = ids[start : start + nb]
        start += nb
        fill(own, n)
        full.append(prefix + own + [spare] * (width - num_prefix - nb))
        suffix.append(own + [spare] * (width - nb))
    total_q = sum(case.q_lens)
    q = torch.randn(total_q, case.num_heads, d, generator=gen) * (8.0 if case.query == "peaky" else 1.0)
    cu = [0]
    for m in case.q_lens:
        cu.append(cu[-1] + m)
    dev = torch.device(device)

    def ints(rows) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int32, device=dev)

    return CascadeInputs(
        q=q.to(dt).to(dev), k_cache=k_cache.to(dev), v_cache=v_cache.to(dev),
        full_tables=ints(full), full_lens=ints([case.prefix_len + n for n in case.suffix_lens]),
        suffix_tables=ints(suffix), suffix_lens=ints(list(case.suffix_lens)),
        prefix_tables=ints([prefix + [spare] * (width - num_prefix)] * total_q),
        prefix_lens=ints([case.prefix_len] * total_q), cu_seqlens_q=ints(cu), scale=oracle.default_scale(d),
    )


def expected_full(x: CascadeInputs) -> oracle.OracleResult:
    """The oracle's attention of every query over its sequence's full table (prefix + suffix)."""
    return oracle.prefill(x.q.cpu(), x.k_cache.cpu(), x.v_cache.cpu(), x.full_tables.cpu(), x.full_lens.cpu(),
                          x.cu_seqlens_q.cpu(), scale=x.scale)


def expected_parts(x: CascadeInputs) -> tuple[oracle.OracleResult, oracle.OracleResult]:
    """The oracle's prefix part (each query over the prefix alone) and suffix part (causal, own blocks)."""
    args = (x.k_cache.cpu(), x.v_cache.cpu())
    prefix = oracle.decode(x.q.cpu(), *args, x.prefix_tables.cpu(), x.prefix_lens.cpu(), scale=x.scale)
    suffix = oracle.prefill(x.q.cpu(), *args, x.suffix_tables.cpu(), x.suffix_lens.cpu(), x.cu_seqlens_q.cpu(),
                            scale=x.scale)
    return prefix, suffix
