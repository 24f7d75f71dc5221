"""Per-step attention metadata and the attention backends every layer calls.

One engine step runs the tokens of all its sequences flattened into ``T`` rows (no padding)::

    tokens     | seq 0: 5 prompt tokens | seq 1: 1 decode token | seq 2: 3 chunk tokens |
    T index      0  1  2  3  4            5                       6  7  8
    cu_seqlens_q [0, 5, 6, 9]      query_lens (5, 1, 3)      seq_lens [5, 41, 19] (cached after the step)

The queries of sequence ``s`` are the *last* ``query_lens[s]`` of its ``seq_lens[s]`` tokens, whose keys
and values this step writes into the paged cache (``slot_mapping``) before attending through the block
tables. :class:`AttentionMetadata` is built once per step and passed to every layer (never a global).

Backends (chosen by :func:`get_attention_backend`): ``"triton"`` runs ``kernels``' public launchers,
``"torch"`` runs ``kernels.reference`` (a loop over sequences: the simple oracle), both doing
``write_kv`` then ``paged_decode`` (every query length 1) or ``paged_prefill``; ``"torch-batched"``
(the default on the CPU) gathers the step's K/V once per layer and calls one masked
``scaled_dot_product_attention`` (``batched_attention``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.kv.table_padding import PAD_BLOCK_ID
from pagedbench.refengine.model.batch_invariance import attend_fixed_order
from pagedbench.refengine.model.batched_attention import PaddedLayout, attend, build_padded_layout, store_kv


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where one step's ``T`` tokens go in the paged cache and what each sequence attends to.

    S sequences, T = sum(query_lens) tokens; tensors live on the model's device, the python fields and
    ``host_block_tables`` on the host (so nothing about the step's shape is ever read back from a device).
    ``validated``: every index was checked when this was built (block ids against ``num_blocks``, lengths
    against the table's capacity), so the launchers run without validating again.
    """

    slot_mapping: torch.Tensor  # int64 [T]: cache slot (block_id * block_size + offset) of each new token
    block_tables: torch.Tensor  # int32 [S, max_blocks]: physical block ids, padded with PAD_BLOCK_ID
    seq_lens: torch.Tensor  # int32 [S]: tokens of each sequence in the cache after this step
    cu_seqlens_q: torch.Tensor  # int32 [S+1]: offsets of each sequence's queries in the T rows
    query_lens: tuple[int, ...]  # new tokens of each sequence this step (python ints)
    max_query_len: int
    is_decode_only: bool  # every query length is 1 (T == S): the decode kernel serves the step
    host_seq_lens: tuple[int, ...] = ()  # seq_lens as python ints
    host_block_tables: np.ndarray | None = None  # int32 [S, max_blocks]: block_tables on the host
    max_seq_len: int = 0  # max(seq_lens)
    validated: bool = False  # indices checked at build: launchers need not validate (see above)
    padded: PaddedLayout | None = None  # the batched torch backend's gather layout (its plan)
    # the model runs the batch-invariant arithmetic (``batch_invariance``): fixed row tiles, and every
    # backend attends with ``attend_fixed_order`` over the gather layout after writing the K/V its own way
    batch_invariant: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    @property
    def launcher_validate(self) -> bool | None:
        """``validate=`` for the launchers: False once checked here; None (their default) otherwise."""
        return False if self.validated else None

    def last_token_indices(self) -> torch.Tensor:
        """int64 [S]: the row in ``T`` of each sequence's last query token (its next-token logits)."""
        return self.cu_seqlens_q[1:].to(torch.int64) - 1

    @classmethod
    def build(
        cls,
        *,
        slot_mapping: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        device: torch.device | str | None = None,
        block_size: int | None = None,
        num_blocks: int | None = None,
    ) -> AttentionMetadata:
        """Metadata from python lists (one entry per sequence; ``slot_mapping`` one per token).

        Raises :class:`InvalidArgumentError` naming the mismatch when the lists disagree. With
        ``block_size`` and ``num_blocks`` every index is checked too (see :meth:`from_host`).
        """
        query_lens = [int(n) for n in query_lens]
        num_seqs = len(query_lens)
        if num_seqs == 0:
            raise InvalidArgumentError("AttentionMetadata.build needs at least one sequence; got 0")
        if len(seq_lens) != num_seqs or len(block_tables) != num_seqs:
            raise InvalidArgumentError(
                f"one entry per sequence expected: query_lens has {num_seqs}, seq_lens {len(seq_lens)}, "
                f"block_tables {len(block_tables)}"
            )
        max_blocks = max(1, max(len(t) for t in block_tables))
        table = np.full((num_seqs, max_blocks), PAD_BLOCK_ID, dtype=np.int32)
        for s, row in enumerate(block_tables):
            table[s, :len(row)] = row
        return cls.from_host(block_tables=table, seq_lens=np.asarray(seq_lens, dtype=np.int64),
                             query_lens=np.asarray(query_lens, dtype=np.int64),
                             slot_mapping=np.asarray(slot_mapping, dtype=np.int64), device=device,
                             block_size=block_size, num_blocks=num_blocks)

    @classmethod
    def from_host(
        cls,
        *,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        query_lens: np.ndarray,
        slot_mapping: np.ndarray,
        device: torch.device | str | None = None,
        block_size: int | None = None,
        num_blocks: int | None = None,
        batch_invariant: bool = False,
    ) -> AttentionMetadata:
        """Metadata from host arrays: block_tables int32 [S, max_blocks], seq_lens and query_lens int
        [S], slot_mapping int64 [T]. Checked here, once per step, with vector operations: one length per
        sequence, ``1 <= query_len <= seq_len``, T slots; with ``block_size``, ``seq_len`` within the
        table's capacity; with ``num_blocks`` too, every block id a sequence uses and every slot in
        range (then ``validated`` is True). Raises :class:`InvalidArgumentError` naming the culprit.
        """
        query_lens = np.asarray(query_lens, dtype=np.int64)
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        slot_mapping = np.asarray(slot_mapping, dtype=np.int64)
        check_step_arrays(block_tables, seq_lens, query_lens, slot_mapping, block_size, num_blocks)
        cu = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu[1:])
        tensor = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)  # noqa: E731
        return cls(
            slot_mapping=tensor(slot_mapping, torch.int64),
            block_tables=tensor(block_tables, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            cu_seqlens_q=tensor(cu, torch.int32),
            query_lens=tuple(query_lens.tolist()),
            max_query_len=int(query_lens.max()),
            is_decode_only=bool((query_lens == 1).all()),
            host_seq_lens=tuple(seq_lens.tolist()),
            host_block_tables=np.asarray(block_tables, dtype=np.int32),
            max_seq_len=int(seq_lens.max()),
            validated=block_size is not None and num_blocks is not None,
            batch_invariant=bool(batch_invariant),
        )


def check_step_arrays(block_tables: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                      slot_mapping: np.ndarray, block_size: int | None, num_blocks: int | None) -> None:
    """The checks of :meth:`AttentionMetadata.from_host` (host arrays; see there)."""
    num_seqs = len(query_lens)
    if num_seqs == 0:
        raise InvalidArgumentError("AttentionMetadata.build needs at least one sequence; got 0")
    if block_tables.ndim != 2 or len(seq_lens) != num_seqs or block_tables.shape[0] != num_seqs:
        raise InvalidArgumentError(
            f"one entry per sequence expected: query_lens has {num_seqs}, seq_lens {len(seq_lens)}, "
            f"block_tables {block_tables.shape[0] if block_tables.ndim else 0}"
        )
    bad = np.flatnonzero((query_lens < 1) | (query_lens > seq_lens))
    if bad.size:
        s = int(bad[0])
        raise InvalidArgumentError(f"sequence {s}: need 1 <= query_len <= seq_len; got "
                                   f"query_len={int(query_lens[s])}, seq_len={int(seq_lens[s])}")
    if len(slot_mapping) != int(query_lens.sum()):
        raise InvalidArgumentError(f"slot_mapping has {len(slot_mapping)} entries; expected sum(query_lens) "
                                   f"= {int(query_lens.sum())}")
    if block_size is None:
        return
    capacity = block_tables.shape[1] * block_size
    bad = np.flatnonzero(seq_lens > capacity)
    if bad.size:
        s = int(bad[0])
        raise InvalidArgumentError(f"sequence {s}: seq_len {int(seq_lens[s])} exceeds its block table's "
                                   f"capacity {block_tables.shape[1]} blocks x {block_size}")
    if num_blocks is None:
        return
    # entries past a sequence's blocks may hold anything; only when the whole table is not in range (the
    # engine pads with a valid id, so it always is) are the entries in use looked at one by one
    if block_tables.size and (block_tables.min() < 0 or block_tables.max() >= num_blocks):
        used = np.arange(block_tables.shape[1])[None, :] < -(-seq_lens[:, None] // block_size)
        bad = np.argwhere(used & ((block_tables < 0) | (block_tables >= num_blocks)))
        if bad.size:
            s, j = (int(x) for x in bad[0])
            raise InvalidArgumentError(f"block_tables[{s}, {j}] must be a block id in [0, {num_blocks}); "
                                       f"got {int(block_tables[s, j])}")
    bad = np.flatnonzero((slot_mapping < 0) | (slot_mapping >= num_blocks * block_size))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(f"slot_mapping[{i}] must be a slot in [0, {num_blocks * block_size}); "
                                   f"got {int(slot_mapping[i])}")


class AttentionBackend(Protocol):
    """What every layer calls: store the step's K/V, then attend through the block tables.

    ``plan`` runs once per step before the layers (FlashInfer's plan/run): it returns the metadata with
    whatever per-step layout the backend needs attached (the same object when it needs none)."""

    name: str

    def plan(self, meta: AttentionMetadata, block_size: int) -> AttentionMetadata: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] (rotary applied), caches [num_blocks, block_size, Hkv, D]
        of q's dtype -> out [T, Hq, D] in q's dtype. Writes k, v into the caches at ``meta.slot_mapping``."""
        ...


class _LauncherBackend:
    """A backend over a module with the ``kernels`` launcher contract.

    Uses ``write_kv``, ``paged_decode`` and ``paged_prefill``; validation is off when the metadata was
    checked at build (``meta.launcher_validate``).
    """

    name = "unnamed"

    def _ops(self):
        raise NotImplementedError

    def plan(self, meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
        return plan_padded(meta, block_size) if meta.batch_invariant else meta

    def _prefill_kwargs(self, meta: AttentionMetadata) -> dict:
        return {}

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ops = self._ops()
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.batch_invariant:
            layout = plan_padded(meta, k_cache.shape[1]).padded
            return attend_fixed_order(q, k_cache, v_cache, layout, scale)
        if meta.is_decode_only:
            return ops.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale=scale,
                                    validate=meta.launcher_validate)
        return ops.paged_prefill(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, scale=scale,
            validate=meta.launcher_validate, **self._prefill_kwargs(meta),
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TritonBackend(_LauncherBackend):
    """The Triton kernels (``kernels``' public launchers): compiled on a GPU, interpreted on the CPU."""

    name = "triton"

    def _ops(self):
        from pagedbench import kernels

        missing = [op for op in ("write_kv", "paged_decode", "paged_prefill") if not hasattr(kernels, op)]
        if missing:
            raise RuntimeError(f"the Triton launchers {missing} are not available in `kernels`")
        return kernels

    def _prefill_kwargs(self, meta: AttentionMetadata) -> dict:
        # the grid's size from the host, not read back from cu_seqlens_q (a device sync per layer)
        return {"max_query_len": meta.max_query_len}


class TorchBackend(_LauncherBackend):
    """The pure-torch references (``kernels.reference``), a loop over sequences: the simple oracle."""

    name = "torch"

    def _ops(self):
        from pagedbench.kernels import reference

        return reference


def plan_padded(meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
    """``meta`` with its gather layout (``batched_attention``) attached; itself if it has one."""
    if meta.padded is not None:
        return meta
    if meta.host_block_tables is None:  # built by hand: read the tables back (a sync on a GPU)
        tables = meta.block_tables.cpu().numpy()
        seq_lens = meta.seq_lens.cpu().numpy()
    else:
        tables, seq_lens = meta.host_block_tables, np.asarray(meta.host_seq_lens)
    layout = build_padded_layout(tables, seq_lens, np.asarray(meta.query_lens), block_size,
                                 device=meta.slot_mapping.device)
    return replace(meta, padded=layout)


class BatchedTorchBackend:
    """The step's attention in one masked ``scaled_dot_product_attention`` per group of sequences
    (``refengine.model.batched_attention``): the default on the CPU.

    ``plan`` builds the gather layout from the metadata's host arrays once per step; every layer reuses it.
    """

    name = "torch-batched"

    def plan(self, meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
        return plan_padded(meta, block_size)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        block_size = k_cache.shape[1]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, block_size)
        layout = plan_padded(meta, block_size).padded
        if meta.batch_invariant:
            return attend_fixed_order(q, k_cache, v_cache, layout, scale)
        return attend(q, k_cache, v_cache, layout, scale)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


BACKENDS: dict[str, type] = {"triton": TritonBackend, "torch": TorchBackend,
                             "torch-batched": BatchedTorchBackend}


def default_backend_name() -> str:
    """``"triton"`` on a GPU, ``"torch-batched"`` on the CPU (as decided by ``kernels.device.backend()``)."""
    from pagedbench.kernels import device

    return "triton" if device.backend().is_gpu else "torch-batched"


def get_attention_backend(name: str | AttentionBackend | None = None) -> AttentionBackend:
    """A backend by name (``"triton"``, ``"torch"``, ``"torch-batched"``), an instance passed through, or
    None for the default."""
    if name is None:
        name = default_backend_name()
    if not isinstance(name, str):
        if callable(getattr(name, "forward", None)):
            return name
        raise InvalidArgumentError(
            f"attention_backend must be a name or a backend; got {type(name).__name__}"
        )
    try:
        return BACKENDS[name.strip().lower()]()
    except KeyError:
        raise InvalidArgumentError(
            f"unknown attention backend {name!r}; known: {', '.join(sorted(BACKENDS))}"
        ) from None
