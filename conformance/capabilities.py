"""What an implementation declares it supports, and the per-case check the suite makes against it.

An adapter sets ``capabilities = Capabilities(...)``; a case that needs something the implementation does
not declare is reported "not supported" for that case only (a skip whose reason starts with
``not supported:``), and a property a case can do without (the LSE, bit-exact batch invariance) is left
out of that case's comparison while everything else is still judged. The unchecked property is recorded
in the case's result (``not_supported`` in the gate's JSON).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: at most this many boundaries of each kind are judged (three cases each)
MAX_BOUNDARIES = 6


@dataclass(frozen=True, slots=True)
class DispatchBoundaries:
    """Where an implementation's own rules switch kernels or plans; the suite puts cases at N-1, N and N+1
    around each (a kernel wrong only for the sizes a rule sends to it is then reached from both sides)."""

    decode_batch_sizes: tuple[int, ...] = ()  # numbers of sequences (of 2 KV heads) at which decode switches
    context_lens: tuple[int, ...] = ()  # sequence lengths (keys) at which decode or prefill switches
    gqa_groups: tuple[int, ...] = ()  # query heads per KV head at which decode switches
    query_lens: tuple[int, ...] = ()  # longest query chunk (tokens) of a batch at which prefill switches

    def __post_init__(self) -> None:
        for name in ("decode_batch_sizes", "context_lens", "gqa_groups", "query_lens"):
            values = getattr(self, name)
            if (not isinstance(values, tuple) or len(values) > MAX_BOUNDARIES
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)):
                raise ValueError(f"DispatchBoundaries.{name} must be a tuple of at most {MAX_BOUNDARIES} integers "
                                 f">= 1; got {values!r}")

    def as_record(self) -> dict[str, list[int]]:
        return {"decode_batch_sizes": list(self.decode_batch_sizes), "context_lens": list(self.context_lens),
                "gqa_groups": list(self.gqa_groups), "query_lens": list(self.query_lens)}


@dataclass(frozen=True, slots=True)
class Capabilities:
    """The optional parts of the contract an implementation supports (the defaults: everything)."""

    returns_lse: bool = True  # return_lse=True gives (out, lse)
    block_sizes: frozenset[int] | None = None  # the block sizes it accepts; None: any
    supports_num_splits: bool = True  # honours num_splits= (split-K decode)
    zero_length_rows: bool = True  # sequences of length 0 (decode) / with 0 queries (prefill)
    batch_invariant: bool = True  # a sequence alone or in a batch gives bit-identical rows (split count pinned)
    # its own dispatch (num_splits=None, its own tile choices) gives a sequence bit-identical rows whatever
    # its neighbours (their number, lengths, the table's width): off unless declared, since launchers
    # commonly choose split-K and tiles by the batch
    batch_invariant_dispatch: bool = False
    sliding_window: bool = True  # sliding_window=
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES  # the dtypes it claims
    # float8_e4m3fn K/V caches, with per-tensor k_scale= / v_scale= keywords on write_kv, paged_decode and
    # paged_prefill (stored value = k / k_scale, read as stored * k_scale); off unless declared, since an
    # adapter written before it would be handed keywords it does not know
    fp8_kv_cache: bool = False
    # where its dispatch rules switch (see DispatchBoundaries); None: nothing declared, the family is
    # "not supported" for it
    dispatch_boundaries: DispatchBoundaries | None = None

    def as_record(self) -> dict[str, object]:
        """Plain values, for result files."""
        return {
            "returns_lse": self.returns_lse,
            "block_sizes": None if self.block_sizes is None else sorted(self.block_sizes),
            "supports_num_splits": self.supports_num_splits,
            "zero_length_rows": self.zero_length_rows,
            "batch_invariant": self.batch_invariant,
            "batch_invariant_dispatch": self.batch_invariant_dispatch,
            "sliding_window": self.sliding_window,
            "dtypes": [str(d).removeprefix("torch.") for d in self.dtypes],
            "fp8_kv_cache": self.fp8_kv_cache,
            "dispatch_boundaries": None if self.dispatch_boundaries is None else self.dispatch_boundaries.as_record(),
        }


def missing_for(impl, case, *, num_splits: int | None = None) -> str | None:
    """Why ``impl`` cannot run ``case`` (a ``cases.AttentionCase``), or None when it can.

    ``num_splits`` is the split count a test passes on top of the case's own.
    """
    caps: Capabilities = impl.capabilities
    if case.torch_dtype not in impl.dtypes or case.torch_dtype not in caps.dtypes:
        return f"{impl.name} does not claim {case.dtype}"
    if caps.block_sizes is not None and case.block_size not in caps.block_sizes:
        return f"{impl.name} does not support block_size {case.block_size}"
    if case.sliding_window is not None and not caps.sliding_window:
        return f"{impl.name} does not support sliding_window"
    splits = num_splits if num_splits is not None else case.num_splits
    if case.op == "decode" and splits is not None and not caps.supports_num_splits:
        return f"{impl.name} does not support num_splits"
    empty = 0 in case.seq_lens or (case.op == "prefill" and 0 in case.effective_q_lens)
    if empty and not caps.zero_length_rows:
        return f"{impl.name} does not support zero-length rows"
    return None


def require(impl, case, *, num_splits: int | None = None) -> None:
    """Skip the running test as "not supported" when ``impl`` cannot run ``case``."""
    reason = missing_for(impl, case, num_splits=num_splits)
    if reason is not None:
        pytest.skip(f"not supported: {reason}")


#: properties left unchecked in the running test because the implementation lacks them: nodeid -> names
UNCHECKED: dict[str, set[str]] = {}


def note_unchecked(what: str) -> None:
    """Record that the running test left ``what`` unchecked (e.g. "lse"): the gate's JSON shows it."""
    from pagedbench.conformance.gate.checks import _current_test

    UNCHECKED.setdefault(_current_test(), set()).add(what)


def take_unchecked(nodeid: str) -> list[str]:
    return sorted(UNCHECKED.pop(nodeid, ()))
