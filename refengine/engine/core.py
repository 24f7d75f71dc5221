"""One engine loop for every use: ``Scheduler.schedule() -> Executor.execute() -> Scheduler.update()``.

The scheduler decides who runs and where their KV lives; an executor runs the step and returns the
sampled tokens, never deciding anything. Two executors plug into the same loop:

- :class:`~pagedbench.refengine.engine.model_executor.ModelExecutor`: the real model and attention
  backend (``LLM.generate``, on the wall clock);
- :class:`SimulatedExecutor`: no weights, no tensors. Each step's tokens come from a replay table or a
  filler (requests end at their ``max_tokens``), and its duration from a step-cost model; the loop's
  :class:`SimClock` advances by that duration (the serving simulator).

A step is a transaction: one that raises (in planning, the executor or the update) is rolled back by
recompute-preempting every sequence it touched (:meth:`Scheduler.roll_back`) and rewinding their
generators, then the exception propagates; the next step is planned as if the failed one never was.

Nothing here imports torch: a simulation of hours of serving runs the real scheduler and KV manager
with nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from pagedbench.refengine.engine.request import Request
from pagedbench.refengine.engine.sampling_params import SamplingParams, derive_seed
from pagedbench.refengine.engine.scheduler import Scheduler, SchedulerOutput
from pagedbench.refengine.engine.sequence import Sequence
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.kv.token_checks import checked_token_list


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step costs depends on: the work of each chunk the scheduler planned.

    ``prefill_chunks``: ``(num_query_tokens, context_len)`` of every chunk computing more than one token
    (a prompt, a prompt chunk, a recomputation after preemption); ``context_len`` counts the chunk's own
    tokens. ``decode_context_lens``: the context length of every one-token chunk.
    """

    prefill_chunks: tuple[tuple[int, int], ...]
    decode_context_lens: tuple[int, ...]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(q for q, _ in self.prefill_chunks)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decode_context_lens)

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        prefill, decode = [], []
        for c in out.chunks:
            if c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens:
                decode.append(c.end)
            else:
                prefill.append((c.num_tokens, c.end))
        return cls(tuple(prefill), tuple(decode))


@dataclass(frozen=True, slots=True)
class StepResult:
    """What an executor returns: ``sampled`` maps seq_id -> new token for every sequence that sampled
    (the children of a just-prefilled parallel-sampling request included); ``elapsed_s`` is the step's
    modelled duration (None: the step took real time, read from the wall clock); ``logprobs`` maps
    seq_id -> ``{token_id: logprob}`` for each sequence that sampled and asked for logprobs."""

    sampled: Mapping[int, int]
    elapsed_s: float | None = None
    logprobs: Mapping[int, dict[int, float]] | None = None


class Executor(Protocol):
    def execute(self, out: SchedulerOutput) -> StepResult: ...


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step as the loop saw it."""

    output: SchedulerOutput
    sampled: Mapping[int, int]
    finished: tuple[Sequence, ...]  # sequences that finished in the step (blocks freed)
    start_s: float  # clock time when the step began
    end_s: float  # clock time when it ended (its tokens are out)


class WallClock:
    """Real time (``time.perf_counter``); an executor's modelled duration is ignored."""

    def now(self) -> float:
        return time.perf_counter()

    def advance(self, seconds: float) -> None:
        pass


class SimClock:
    """Simulated time: moves only when told (a step's modelled duration, or a jump to an arrival)."""

    __slots__ = ("t",)

    def __init__(self, start_s: float = 0.0) -> None:
        self.t = start_s

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds})")
        self.t += seconds

    def advance_to(self, t: float) -> None:
        if t > self.t:
            self.t = t


class SimulatedExecutor:
    """Runs no model. ``step_time_s(shape)`` gives each step's duration; tokens come from ``replay``
    (seq_id -> the tokens that sequence generated in a real run) or are ``filler_token``.

    With filler tokens a request ends at its ``max_tokens`` (give it ``ignore_eos=True``), which is how a
    trace's output length is served.
    """

    def __init__(self, step_time_s: Callable[[StepShape], float], *,
                 replay: Mapping[int, list[int]] | None = None, filler_token: int = 0) -> None:
        self.step_time_s = step_time_s
        self.replay = replay
        self.filler_token = filler_token

    def execute(self, out: SchedulerOutput) -> StepResult:
        sampled: dict[int, int] = {}
        replay, filler = self.replay, self.filler_token
        for c in out.chunks:
            if not c.samples:
                continue
            seq = c.seq
            if replay is None and not seq.pending_children:  # the commonest case, once per sequence
                sampled[seq.seq_id] = filler
                continue
            for s in (seq, *seq.pending_children):
                sampled[s.seq_id] = filler if replay is None else replay[s.seq_id][s.num_output_tokens]
        return StepResult(sampled, self.step_time_s(StepShape.of(out)))


def _record_logprobs(out: SchedulerOutput, logprobs: Mapping[int, dict[int, float]]) -> None:
    """Give each sequence that sampled its step's logprobs (before the update forks children)."""
    for c in out.chunks:
        if c.samples:
            for s in (c.seq, *c.seq.pending_children):
                entry = logprobs.get(s.seq_id)
                if entry is not None and s.logprobs is not None:
                    s.logprobs.append(entry)


class EngineCore:
    """Requests in, steps out: builds each request's sequences and runs the loop on ``clock``.

    ``can_fork``: the KV manager shares blocks (paged), so the children of an ``n > 1`` request fork
    from child 0 once its prompt is computed; otherwise every child computes the prompt itself.
    ``make_generator(base_seed, child_index)``: a sampled child's own sampler state (the model
    executor's torch generator; None in a simulation); ``rewind_generator(generator, num_draws)`` puts
    one back to where it was after ``num_draws`` draws (after a failed step).

    ``requests``: the requests queued and not finished, by id. ``rolled_back``: the sequences the last
    failed step touched (now waiting again), empty until a step fails.
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, *, clock=None, can_fork: bool = True,
                 seed: int = 0, make_generator: Callable[[int, int], object] | None = None,
                 rewind_generator: Callable[[object, int], None] | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock if clock is not None else WallClock()
        self.can_fork = can_fork
        self.seed = seed
        self.make_generator = make_generator
        self.rewind_generator = rewind_generator
        self.next_request_id = 0
        self.next_seq_id = 0
        self.requests: dict[int, Request] = {}
        self.rolled_back: tuple[Sequence, ...] = ()

    def new_request(self, token_ids: list[int], params: SamplingParams, *, prompt: str | None = None,
                    error: str | None = None, cache_salt: str | None = None,
                    arrival_s: float | None = None, check_tokens: bool = True) -> Request:
        """A request with its sequences built (not queued: see :meth:`add`). A request with ``error``
        gets an id and no sequences.

        The prompt's ids are checked here, once (InvalidArgumentError naming the problem, nothing
        changed): its sequences' allocations then need not read them again. ``check_tokens=False``: the
        caller vouches that they are plain ints in ``[0, 2**63)`` (it checked them, as
        :class:`~pagedbench.refengine.engine.llm.LLM` does against the vocabulary, or made them)."""
        if check_tokens is not True and check_tokens is not False:
            raise InvalidArgumentError(f"check_tokens must be a bool, got {check_tokens!r}")
        if error is None and check_tokens:
            token_ids = checked_token_list(token_ids)
        request_id = self.next_request_id
        self.next_request_id += 1
        req = Request(request_id, tuple(token_ids), prompt, params, error, cache_salt=cache_salt,
                      arrival_s=arrival_s)
        if error is not None:
            return req
        make = None if params.greedy else self.make_generator  # (a greedy request draws nothing)
        if make is not None:
            base = params.seed if params.seed is not None else derive_seed(self.seed, request_id)
        for i in range(params.n):
            gen = None if make is None else make(base, i)
            req.children.append(Sequence(self.next_seq_id, request_id, i, list(token_ids), len(token_ids),
                                         params, gen, cache_salt=cache_salt,
                                         logprobs=None if params.logprobs is None else [], prompt_checked=True))
            self.next_seq_id += 1
        if self.can_fork:
            req.children[0].pending_children = req.children[1:]
            req.queued = req.children[:1]
        else:
            req.queued = list(req.children)
        return req

    def add(self, req: Request) -> None:
        """Queue a request's sequences (arrival now, unless the request says when)."""
        if req.arrival_s is None:
            req.arrival_s = self.clock.now()
        if req.queued:
            self.requests[req.request_id] = req
        for seq in req.queued:
            self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepReport:
        """Plan, run and record one step; on any exception (KeyboardInterrupt included) the step is
        rolled back (see the module docstring) and the exception re-raised."""
        clock = self.clock
        start = clock.now()
        if self.rolled_back:
            self.rolled_back = ()
        try:
            out = self.scheduler.schedule()
            result = self.executor.execute(out)
            if result.elapsed_s is not None:
                clock.advance(result.elapsed_s)
            if result.logprobs:
                _record_logprobs(out, result.logprobs)
            finished = self.scheduler.update(out, result.sampled)
        except BaseException:
            self._roll_back()
            raise
        end = clock.now()
        self.record_finished(finished, end)
        return StepReport(out, result.sampled, tuple(finished), start, end)

    def record_finished(self, finished: list[Sequence], end_s: float) -> None:
        """Stamp sequences that finished in a step ending at ``end_s``, and forget the requests they
        complete (also for a simulator that serves steps without :meth:`step`)."""
        requests = self.requests
        for seq in finished:
            seq.finish_s = end_s
            req = requests.get(seq.request_id)
            if req is not None and req.finished:
                del requests[seq.request_id]

    def _roll_back(self) -> None:
        seqs = self.scheduler.roll_back()
        rewind = self.rewind_generator
        if rewind is not None:
            for seq in seqs:
                for s in (seq, *seq.pending_children):
                    if s.generator is not None:
                        rewind(s.generator, s.num_output_tokens)
        self.rolled_back = tuple(seqs)

    def abort(self, request_id: int) -> bool:
        """Abort a queued request in any state: its sequences end with ``"abort"`` and their blocks are
        freed now. Returns False when it is not queued (finished, aborted, or never added)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def abort_all(self) -> None:
        self.scheduler.abort_all()
        self.requests.clear()
