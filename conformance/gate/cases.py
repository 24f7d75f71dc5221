"""Conformance cases as data: frozen records with stable readable ids, and the one tolerance table.

A case id reads like ``decode/bs=16,ctx=97,hq=4,hkv=2,d=64,fp16`` (extras such as ``,q=3+1``,
``,win=7``, ``,splits=4``, ``,peaky`` follow). The seed of a case's random inputs is derived from its id
(CRC-32), so a failing case id reproduces its inputs exactly; it is shown in every failure message.

Grids are built "a control case plus one axis at a time" (the WebGPU CTS habit): :func:`vary` copies the
control with one field changed; the full cartesian sweep lives under the ``slow`` marker.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Bounds for one dtype: ``‖out − ref‖ / ‖ref‖ <= rel`` and ``max |out − ref| <= max_abs``;
    ``lse_abs`` bounds ``max |lse − ref_lse|`` (LSE is float32 whatever the input dtype)."""

    rel: float
    max_abs: float
    lse_abs: float


#: The one tolerance table. Never loosened to make an implementation pass.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rel=1e-5, max_abs=1e-4, lse_abs=1e-4),
    torch.float16: Tolerance(rel=1e-3, max_abs=1e-2, lse_abs=1e-3),
    torch.bfloat16: Tolerance(rel=1e-2, max_abs=6e-2, lse_abs=1e-2),
}


@dataclass(frozen=True, slots=True)
class Fp8Bound:
    """What storing ``x`` in an fp8 cache with scale ``s`` may change, from the format alone: the stored
    ``q = round(x / s)`` (to nearest) read back as ``q * s`` is within ``s * max(rel * |x / s|, abs_min)``
    of ``x`` for ``|x / s| <= max_value`` (``rel``: half an ulp of the mantissa; ``abs_min``: half the
    smallest subnormal), and exactly ``+-max_value * s`` beyond (saturation). Attention over an fp8 cache
    is judged against the oracle over the dequantized cache, with q's dtype's tolerance."""

    rel: float
    abs_min: float
    max_value: float


#: float8_e4m3fn: 3 mantissa bits (half ulp 2^-4 relative), smallest subnormal 2^-9, largest finite 448
FP8_E4M3 = Fp8Bound(rel=2.0 ** -4, abs_min=2.0 ** -10, max_value=448.0)


class SeededCase:
    """What a case derives from its ``id`` and ``dtype`` (a mixin of the case dataclasses): its seed, a
    hash of the id, so a case's inputs never depend on which other cases run; its torch dtype; and its
    dtype's tolerance."""

    __slots__ = ()

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id.encode())

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def tolerance(self) -> Tolerance:
        return TOLERANCES[self.torch_dtype]


@dataclass(frozen=True, slots=True)
class AttentionCase(SeededCase):
    """One attention call: the shapes, lengths and options; inputs come from ``builders.build``.

    ``seq_lens[s]`` tokens of sequence ``s`` are in the cache; for prefill ``q_lens[s]`` of them (its
    last ones) are queries. ``query`` is ``"randn"`` or ``"peaky"`` (queries scaled ×8, so softmax is
    far from uniform). ``pad`` is what the block-table entries past a sequence's length hold:
    ``"poison"`` (ids of NaN-filled blocks) or ``"garbage"`` (-1).
    """

    op: str  # "decode" or "prefill"
    block_size: int
    seq_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "fp16"
    q_lens: tuple[int, ...] | None = None  # prefill only; None means every token is a query
    sliding_window: int | None = None
    num_splits: int | None = None  # decode only; None lets the implementation choose
    query: str = "randn"
    pad: str = "poison"
    spare_blocks: int = 2  # unreferenced (poisoned) blocks in the cache

    @property
    def id(self) -> str:
        ctx = "+".join(str(n) for n in self.seq_lens)
        parts = [f"bs={self.block_size}", f"ctx={ctx}", f"hq={self.num_heads}", f"hkv={self.num_kv_heads}",
                 f"d={self.head_dim}", self.dtype]
        if self.op == "prefill" and self.q_lens is not None:
            parts.append("q=" + "+".join(str(n) for n in self.q_lens))
        if self.sliding_window is not None:
            parts.append(f"win={self.sliding_window}")
        if self.num_splits is not None:
            parts.append(f"splits={self.num_splits}")
        if self.query != "randn":
            parts.append(self.query)
        if self.pad != "poison":
            parts.append(f"pad={self.pad}")
        return f"{self.op}/" + ",".join(parts)


    @property
    def effective_q_lens(self) -> tuple[int, ...]:
        if self.op == "decode":
            return tuple(1 for _ in self.seq_lens)
        return self.seq_lens if self.q_lens is None else self.q_lens


def vary(case: AttentionCase, **changes) -> AttentionCase:
    """A copy of ``case`` with some fields changed (a new record; cases are never mutated)."""
    return dataclasses.replace(case, **changes)


#: block sizes of the grid: 1, a non-power of two, the usual 16, 32 and a large one
BLOCK_SIZES = (1, 5, 16, 32, 128)
#: (num_heads, num_kv_heads): MHA, GQA 4, the non-power-of-two ratio 5, GQA 8, MQA
HEAD_LAYOUTS = ((2, 2), (8, 2), (10, 2), (16, 2), (4, 1))
HEAD_DIMS = (64, 80, 96, 128, 256, 24, 72)
LONG_LEN = 3000


def edge_lengths(block_size: int) -> tuple[int, ...]:
    """1, B−1, B, B+1, 2B−1, 2B, 2B+1 (duplicates and zeros removed, order kept)."""
    b = block_size
    seen: list[int] = []
    for n in (1, b - 1, b, b + 1, 2 * b - 1, 2 * b, 2 * b + 1):
        if n >= 1 and n not in seen:
            seen.append(n)
    return tuple(seen)


def case_ids(cases) -> list[str]:
    return [c.id for c in cases]
