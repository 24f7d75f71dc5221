"""Per-step attention metadata and the attention backends every layer calls.

One engine step runs the tokens of all its sequences flattened into ``T`` rows (no padding)::

    tokens     | seq 0: 5 prompt tokens | seq 1: 1 decode token | seq 2: 3 chunk tokens |
    T index      0  1  2  3  4            5                       6  7  8
    cu_seqlens_q [0, 5, 6, 9]      query_lens (5, 1, 3)      seq_lens [5, 41, 19] (cached after the step)

The queries of sequence ``s`` are the *last* ``query_lens[s]`` of its ``seq_lens[s]`` tokens, whose keys
and values this step writes into the paged cache (``slot_mapping``) before attending through the block
tables. :class:`AttentionMetadata` is built once per step and passed to every layer (never a global).

Backends (chosen by :func:`get_attention_backend`): ``"triton"`` runs ``kernels``' public launchers,
``"torch"`` runs ``kernels.reference`` (the practical CPU path). Both do ``write_kv`` then
``paged_decode`` (every query length 1) or ``paged_prefill``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from pagedbench.refengine.errors import InvalidArgumentError

#: block-table entries past a sequence's last block (never read by the kernels)
PAD_BLOCK_ID = 0


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where one step's ``T`` tokens go in the paged cache and what each sequence attends to.

    S sequences, T = sum(query_lens) tokens; tensors live on the model's device.
    """

    slot_mapping: torch.Tensor  # int64 [T]: cache slot (block_id * block_size + offset) of each new token
    block_tables: torch.Tensor  # int32 [S, max_blocks]: physical block ids, padded with PAD_BLOCK_ID
    seq_lens: torch.Tensor  # int32 [S]: tokens of each sequence in the cache after this step
    cu_seqlens_q: torch.Tensor  # int32 [S+1]: offsets of each sequence's queries in the T rows
    query_lens: tuple[int, ...]  # new tokens of each sequence this step (python ints)
    max_query_len: int
    is_decode_only: bool  # every query length is 1 (T == S): the decode kernel serves the step

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

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
    ) -> AttentionMetadata:
        """Metadata from python lists (one entry per sequence; ``slot_mapping`` one per token).

        Raises :class:`InvalidArgumentError` naming the mismatch when the lists disagree.
        """
        query_lens = tuple(int(n) for n in query_lens)
        seq_lens = [int(n) for n in seq_lens]
        num_seqs = len(query_lens)
        if num_seqs == 0:
            raise InvalidArgumentError("AttentionMetadata.build needs at least one sequence; got 0")
        if len(seq_lens) != num_seqs or len(block_tables) != num_seqs:
            raise InvalidArgumentError(
                f"one entry per sequence expected: query_lens has {num_seqs}, seq_lens {len(seq_lens)}, "
                f"block_tables {len(block_tables)}"
            )
        for s, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
            if not 1 <= q_len <= s_len:
                raise InvalidArgumentError(
                    f"sequence {s}: need 1 <= query_len <= seq_len; got query_len={q_len}, seq_len={s_len}"
                )
        if len(slot_mapping) != sum(query_lens):
            raise InvalidArgumentError(
                f"slot_mapping has {len(slot_mapping)} entries; expected sum(query_lens) = {sum(query_lens)}"
            )
        max_blocks = max(1, max(len(t) for t in block_tables))
        rows = [list(row) + [PAD_BLOCK_ID] * (max_blocks - len(row)) for row in block_tables]
        cu = [0]
        for q_len in query_lens:
            cu.append(cu[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(list(slot_mapping), dtype=torch.int64, device=device),
            block_tables=torch.tensor(rows, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            query_lens=query_lens,
            max_query_len=max(query_lens),
            is_decode_only=all(q == 1 for q in query_lens),
        )


class AttentionBackend(Protocol):
    """What every layer calls: store the step's K/V, then attend through the block tables."""

    name: str

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

    Uses ``write_kv``, ``paged_decode`` and ``paged_prefill``.
    """

    name = "unnamed"

    def _ops(self):
        raise NotImplementedError

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ops = self._ops()
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return ops.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale=scale)
        return ops.paged_prefill(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, scale=scale
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


class TorchBackend(_LauncherBackend):
    """The pure-torch references (``kernels.reference``): the practical path on a CPU."""

    name = "torch"

    def _ops(self):
        from pagedbench.kernels import reference

        return reference


BACKENDS: dict[str, type[_LauncherBackend]] = {"triton": TritonBackend, "torch": TorchBackend}


def default_backend_name() -> str:
    """``"triton"`` on a GPU, ``"torch"`` on the CPU (as decided by ``kernels.device.backend()``)."""
    from pagedbench.kernels import device

    return "triton" if device.backend().is_gpu else "torch"


def get_attention_backend(name: str | AttentionBackend | None = None) -> AttentionBackend:
    """A backend by name (``"triton"``, ``"torch"``), an instance passed through, or None for the default."""
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
