"""The records of a scheduled step: the chunks it computes, the copy-on-write copies it applies first, and
the rule that ends a sequence (:mod:`pagedbench.refengine.engine.scheduler` plans them; the executors,
the engine core and the serving simulator read them).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedbench.refengine.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy-on-write copy to apply to the KV pool (every layer, K and V) before the step runs."""

    src: int  # physical block id to copy from
    dst: int  # physical block id to copy to


@dataclass(frozen=True, slots=True)
class BlockSwap:
    """A block copied between the device pool and the host pool (swap preemption), every layer, K and V.

    In ``SchedulerOutput.swap_out`` ``src`` is a device block and ``dst`` a host block; in ``swap_in``
    ``src`` is a host block and ``dst`` a device block; ``offload_store`` and ``offload_load`` (the prefix
    cache's host tier, a host pool of its own) likewise. The executor applies, in order: swap-outs and
    offload stores (they read device blocks the step may give to other tables), swap-ins and offload loads,
    then copy-on-write copies (a swapped-in sequence's first append may copy a block it brought back).
    """

    src: int  # block id in the pool copied from
    dst: int  # block id in the pool copied to


class ScheduledChunk:
    """``num_tokens`` tokens of ``seq`` computed this step, positions ``[start, start + num_tokens)``.

    ``end`` (``start + num_tokens``) and ``samples`` (the chunk reaches the sequence's last token, so its
    logits give the next token) are worked out once, when the chunk is made: a step reads them for every
    sequence several times, and the sequence's tokens do not change until the step is over. Read-only by
    convention (a plain slotted class: a frozen dataclass cost four times as much to build, once per
    sequence per step).
    """

    __slots__ = ("end", "num_tokens", "samples", "seq", "start")

    def __init__(self, seq: Sequence, start: int, num_tokens: int) -> None:
        self.seq = seq
        self.start = start  # first position computed (== seq.num_computed_tokens when scheduled)
        self.num_tokens = num_tokens  # >= 1
        self.end = end = start + num_tokens
        self.samples = end == len(seq.token_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ScheduledChunk):
            return NotImplemented
        return (self.seq, self.start, self.num_tokens) == (other.seq, other.start, other.num_tokens)

    __hash__ = None  # type: ignore[assignment]  (equal by value, and mutable in principle)

    def __repr__(self) -> str:
        return f"ScheduledChunk(seq_id={self.seq.seq_id}, start={self.start}, num_tokens={self.num_tokens})"


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # in batch order: decodes, then prefill chunks, then admissions
    copies: tuple[BlockCopy, ...]  # copy-on-write copies, to apply before the model runs
    preempted_seq_ids: tuple[int, ...]  # sequences preempted while planning this step
    num_batched_tokens: int  # sum of the chunks' num_tokens
    swap_out: tuple[BlockSwap, ...] = ()  # (device -> host) copies, applied first
    swap_in: tuple[BlockSwap, ...] = ()  # (host -> device) copies, applied after the swap-outs
    # the prefix cache's host tier: evicted cached blocks kept (device -> host, with the swap-outs) and host
    # hits loaded back (host -> device, with the swap-ins, before anything reads them)
    offload_store: tuple[BlockSwap, ...] = ()
    offload_load: tuple[BlockSwap, ...] = ()

    @property
    def is_empty(self) -> bool:
        return (not self.chunks and not self.swap_out and not self.swap_in and not self.offload_store
                and not self.offload_load)


@dataclass(frozen=True, slots=True)
class StopRule:
    """When a sequence finishes (besides its own SamplingParams)."""

    eos_token_ids: frozenset[int]  # the model's EOS ids ("eos" unless ignore_eos)
    max_model_len: int  # a sequence may hold at most this many computed tokens
