"""Per-sequence state: one sequence per completion (child) of a request.

A sequence's ``token_ids`` are its prompt followed by what it generated. At any time

    0 <= num_computed_tokens <= num_table_tokens <= len(token_ids) <= num_table_tokens + 1

where ``num_table_tokens`` is how many tokens the block manager holds room for (``allocate`` gives
the whole prompt room at once; ``append_token`` one more each decode step, *before* that token's K/V is
written) and ``num_computed_tokens`` how many have their K/V in the cache. A sequence samples its next
token in the step that brings ``num_computed_tokens`` to ``len(token_ids)``.

Preemption (recompute) frees the blocks and sets both counts to 0: on re-admission the prompt *and*
the tokens generated so far are allocated and computed again as one prompt, and the generator is kept,
so the sequence continues exactly as it would have without preemption. A failed step is undone the same
way (``Scheduler.roll_back``), with the tokens, logprobs and generator state it had before that step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedbench.refengine.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the scheduler's queue (new, or preempted)
    RUNNING = "running"  # holds blocks; computed a chunk at a time
    FINISHED = "finished"  # blocks freed; finish_reason set


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int  # unique within one engine; the block manager's sequence id
    request_id: int  # the request this is a child of
    child_index: int  # in [0, n); with request_id, the scheduling priority (lower = older)
    token_ids: list[int]  # prompt + generated tokens
    num_prompt_tokens: int  # length of the original prompt
    params: SamplingParams  # shared by every child of the request
    # this child's own sampler state (a torch.Generator from the model executor; None when greedy or
    # simulated): typed loosely so that the scheduler's side imports no torch
    generator: Any | None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_table_tokens: int = 0  # tokens the block manager holds room for
    num_admitted_tokens: int = 0  # tokens given to allocate() at the last admission (the prefill part)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at first admission
    num_preemptions: int = 0  # how many times this sequence was preempted
    finish_reason: str | None = None  # set when FINISHED
    cache_salt: str | None = None  # prefix-cache namespace: only equal salts share cached blocks
    finish_s: float | None = None  # the engine clock when it finished
    # children still to be forked from this one when its prompt's prefill completes (parallel sampling)
    pending_children: list[Sequence] = field(default_factory=list)
    # with SamplingParams.logprobs: one {token_id: logprob} per generated token (else None)
    logprobs: list[dict[int, float]] | None = None
    # its prompt's ids were checked where it entered the engine (EngineCore.new_request): the block
    # manager need not read them again (Scheduler._allocate)
    prompt_checked: bool = False
    # its text, cut at the stop string that ended it (``engine/stop_strings.py``); None: the tokens' decode
    output_text: str | None = None

    @property
    def priority(self) -> tuple[int, int]:
        """Scheduling order: older requests first, then child index."""
        return (self.request_id, self.child_index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_append(self) -> bool:
        """Whether the last sampled token still needs room in the block table."""
        return self.num_table_tokens < len(self.token_ids)

    @property
    def seats(self) -> int:
        """Running slots this sequence will take: itself plus the children it will fork."""
        return 1 + len(self.pending_children)
