"""Runs of decode steps served in one go, with the schedule step-by-step simulation would make.

Between two events that can change a schedule, every step of a simulation is the same: each running
sequence computes its last token and samples the next one. The events are an arrival, a finish, a
preemption (an append with no free block), an admission and a prefill chunk. :meth:`FastForward.advance`
finds how many such steps can pass before the first event, and applies them at once:

- the clock moves step by step as before (each step's duration is ``step_time_s`` of that step's
  :class:`StepShape`, or the same float from the step-time function's own ``decode_run``, see
  :func:`decode_run_of`; added in the same order, so every timestamp is the same float), and the run stops
  before the first step that would start at or after the next arrival when the queue is empty (behind
  a head that cannot be admitted an arrival only queues, at the step it would), or past the window
  without drain;
- no sequence finishes inside the run (it stops the step before the first one would), and the run's
  appends are covered by free blocks (paged) or by the reservations (Orca), so none preempts;
- the queue's head cannot be admitted on any of its steps: the queue is empty, the seats are taken
  (nothing frees one inside the run), in the mixed policy the decodes use the whole token budget, or
  the manager refuses it now (``can_allocate``; with prefix caching ``allocation_preview``, hits
  counted): free blocks only get fewer inside the run and an eviction only loses hits, so it is refused
  on every step, unless the run publishes the block its hits would go on with (the run ends at that
  step, see ``_bound_by_new_hits``); the manager counts one refused ``allocate`` per step
  (``record_refused_allocations``);
- the block manager's calls leave the state the steps would leave: one ``append_token_rounds`` call
  (paged: the block manager takes the run's blocks round by round, within a round in the running
  order, and with prefix caching publishes after each round the blocks it filled, as the steps'
  ``append_token`` calls and the scheduler's ``publish_blocks`` after each step would); one
  ``append_tokens`` call per sequence (Orca: its reservation covers the run). Eviction, publication
  and block ids are those of step-by-step simulation.

Anything else (a prefill chunk, a sequence of a parallel-sampling request, an executor replaying real
tokens, a stop token equal to the filler) falls back to one real step. The simulator's memory
accounting reads every step, so runs with ``account=True`` or ``record_steps=True`` are never skipped.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

from pagedbench.refengine.engine.core import SimulatedExecutor, StepShape

_SEQ_ID = operator.attrgetter("seq_id")
MIN_RUN = 1  # the fewest steps a run takes: even one decode step costs less as a run than as a real step


class FastForward:
    """Advances a serving simulation's run (``serving_sim._Run``) over runs of decode steps."""

    __slots__ = ("bm", "bs", "clock", "decode_run", "executor", "held", "hit_blocks", "paged", "refused", "sched")

    def __init__(self, run) -> None:
        self.sched = run.sched
        self.bm = run.bm
        self.bs = run.bs
        self.clock = run.clock
        self.executor = _simulated(run)
        self.decode_run = decode_run_of(self.executor.step_time_s)
        self.paged = run.spec.kind == "paged"
        self.refused = None  # the queue's head, when the run's steps each try and fail to allocate it
        self.held: list[int] = []  # tokens each running sequence's table holds (set by _bound)
        self.hit_blocks = None  # (hit blocks, tokens) of a refused head with prefix caching (_refuses_now)

    @staticmethod
    def applies(run) -> bool:
        """Whether the run's executor is the simulated one with filler tokens (the only one it models)."""
        ex = _simulated(run)
        return type(ex) is SimulatedExecutor and ex.replay is None

    def advance(self, run) -> bool:
        """Serve a run of at least ``MIN_RUN`` decode steps and return True, or change nothing and return False."""
        k_max = self._bound(run)
        if k_max < MIN_RUN:
            return False
        running = self.sched.running
        clock = self.clock
        next_arrival = run.pending[0].arrival_s if run.pending else math.inf
        stop_after = math.inf if run.cfg.drain else run.window[1]
        ends = [a + 1 for a in self.held]  # each decode chunk's end (its context) at the run's start
        step_s = self.decode_run(tuple(ends))  # step j's duration
        k = 0
        step_ends = []  # each step's end: the time its tokens are out
        while k < k_max:
            if k:
                t = clock.now()
                if t > stop_after:
                    break
                if t >= next_arrival:
                    if not self.sched.waiting:
                        break
                    # behind a head that cannot be admitted, an arrival only joins the queue (a new
                    # request is the youngest): the run goes on
                    run._arrive()
                    next_arrival = run.pending[0].arrival_s if run.pending else math.inf
            clock.advance(step_s(k))
            step_ends.append(clock.now())
            k += 1
        self._apply(running, ends, k)
        # what the step-by-step run observes per step: the measured requests' token times, and the pool's
        # peak use (a run only takes blocks, so its last step holds the most)
        timing = run.timing
        if timing:
            for entry in map(timing.get, map(_SEQ_ID, running)):
                if entry is not None:
                    entry[2].extend(step_ends)
        run.peak_used = max(run.peak_used, self.bm.num_used_blocks)
        if self.refused is not None:  # each step of the run tried to admit it, and was refused
            self.bm.record_refused_allocations(k)
        run.generated += len(running) * k
        run.num_steps += k
        run.peak = max(run.peak, len(running))
        return True

    def _bound(self, run) -> int:
        """The most steps that can pass with no finish, preemption or admission (0: none)."""
        sched = self.sched
        running = sched.running
        b = len(running)
        self.refused = None
        if not b or b > sched.max_num_batched_tokens:
            return 0
        # a queue's head that could be admitted ends the run before it starts: tested first, before the
        # pass over the running sequences (b seats is a lower bound on theirs: the pass checks it)
        if sched.waiting:
            head = sched.waiting[0]
            seats_full = b + head.seats > sched.max_num_seqs
            no_budget = sched.policy == "mixed" and b == sched.max_num_batched_tokens
            if not (seats_full or no_budget):
                if not self._refuses_now(head):
                    return 0
                self.refused = head
        filler = self.executor.filler_token
        eos = sched.stop.eos_token_ids
        k_max = sched.stop.max_model_len  # minus the longest sequence (below)
        longest = 0
        self.held = held = []  # tokens each sequence's table holds at the run's start
        for s in running:  # once per running sequence per run: attributes read inline
            tokens = s.token_ids
            n = len(tokens)
            if (s.num_computed_tokens != n - 1 or s.num_table_tokens != n - 1 or tokens[-1] != filler
                    or s.pending_children):
                return 0
            p = s.params
            if p.n != 1 or filler in p.stop_token_ids or (not p.ignore_eos and filler in eos):
                return 0
            # the step that samples its last token finishes it: the run ends the step before
            left = p.max_tokens - (n - s.num_prompt_tokens) - 1
            if left < k_max:
                if left < MIN_RUN:
                    return 0
                k_max = left
            if n > longest:
                longest = n
            held.append(n - 1)
        k_max = min(k_max, sched.stop.max_model_len - longest)
        if k_max < MIN_RUN:
            return 0
        if self.paged:
            k = self._bound_by_free_blocks(held, k_max)
            if self.refused is not None and self.hit_blocks is not None:
                k = self._bound_by_new_hits(held, k)
            return k
        bm = self.bm
        return min(k_max, *(bm.reserved_tokens(s.seq_id) - a for s, a in zip(running, held)))

    def _refuses_now(self, head) -> bool:
        """Whether the manager refuses ``head`` now, as its own ``can_allocate`` (or with prefix caching
        ``allocation_preview``) says. Free blocks only get fewer inside a run and a take that evicts one
        of the head's hits only loses hits, so it stays refused, unless a block the run publishes gives
        it a new hit: ``hit_blocks`` (prefix caching) keeps its hits for ``_bound_by_new_hits``."""
        sched = self.sched
        self.hit_blocks = None
        if not self.paged and sched.watermark_blocks:
            return False
        if sched.prefix_caching:
            preview = self.bm.allocation_preview(head.token_ids, cache_salt=head.cache_salt,
                                                 **self._admission_kwargs(head))
            self.hit_blocks = (preview.num_hit_blocks, len(head.token_ids))
            return not preview.fits
        return not self.bm.can_allocate(len(head.token_ids), **self._admission_kwargs(head))

    def _bound_by_new_hits(self, held: list[int], k: int) -> int:
        """The most steps (<= k) before a refused head could gain a prefix hit: its hits end at block
        ``h``, which only a block published at index ``h`` can extend (its lookup stops at the first
        miss); a sequence whose table reaches ``(h + 1) * bs`` tokens on step ``j`` publishes block ``h``
        at that step's end, so the run ends with step ``j`` (a conservative cut: the tokens may differ)."""
        h, n = self.hit_blocks
        if h >= (n - 1) // self.bs:  # every block a lookup may serve is a hit already
            return k
        boundary = (h + 1) * self.bs
        for a in held:  # the table holds a tokens, a + 1 + j after step j
            j = boundary - a - 1
            if 0 <= j < k - 1:
                k = j + 1
        return k

    def _admission_kwargs(self, head) -> dict:
        """What the scheduler passes to ``allocate`` for ``head`` that decides whether it fits (no prefix
        cache)."""
        kwargs = {}
        if self.sched.watermark_blocks:
            kwargs["reserve_free_blocks"] = self.sched.watermark_blocks
        if getattr(self.bm, "reserves_by_output_len", False):
            kwargs["output_len"] = head.params.max_tokens - head.num_output_tokens
        return kwargs

    def _bound_by_free_blocks(self, held: list[int], k_max: int) -> int:
        """The most steps (<= k_max) whose new blocks the free ones cover.

        A table holding ``a`` tokens takes a block on the steps ``j`` with ``(a + j) % bs == 0``: its
        offset ``-a % bs``, then every ``bs`` steps. So every ``bs`` steps each sequence takes one block,
        in the order of their offsets, and the take the free blocks cannot cover, the ``free``-th in that
        order, falls on step ``(free // b) * bs + offsets[free % b]``: the run stops before it.
        """
        free, bs = self.bm.num_free_blocks, self.bs
        offsets = sorted([-a % bs for a in held])
        laps, r = divmod(free, len(offsets))
        return min(k_max, laps * bs + offsets[r])

    def _apply(self, running, ends: list[int], k: int) -> None:
        """The scheduler's and the block manager's state after ``k`` decode steps."""
        filler = self.executor.filler_token
        fill = [filler] * k
        if self.paged:  # each step's takes, then (prefix caching) its publications, as update makes them
            self.bm.append_token_rounds(list(map(_SEQ_ID, running)), filler, k,
                                        publish_full_blocks=self.sched.prefix_caching)
            for s in running:
                s.token_ids.extend(fill)
                s.num_computed_tokens = s.num_table_tokens = len(s.token_ids) - 1
            return
        for s, a, e in zip(running, self.held, ends):
            s.token_ids.extend(fill)
            self.bm.append_tokens(s.seq_id, s.token_ids[a:e - 1 + k])
            s.num_computed_tokens = s.num_table_tokens = e - 1 + k


def decode_run_of(step_time_s: Callable[[StepShape], float]) -> Callable[[tuple[int, ...]], Callable[[int], float]]:
    """``decode_run(context_lens)``: the duration of step ``j`` of a run of decode-only steps from those
    context lengths (each one token longer a step), as a function of ``j``; the same float
    ``step_time_s(StepShape((), tuple(c + j for c in context_lens)))`` gives. A step-time function may
    carry its own as ``step_time_s.decode_run`` (at O(1) a step where the shape costs O(batch) to
    build); this is the general one."""
    own = getattr(step_time_s, "decode_run", None)
    if own is not None:
        return own

    def decode_run(context_lens: tuple[int, ...]) -> Callable[[int], float]:
        return lambda j: step_time_s(StepShape((), tuple(map(j.__add__, context_lens))))

    return decode_run


def _simulated(run):
    """The run's simulated executor, under the wrapper that watches each step's KV memory (whose work a
    run does itself: see ``advance``)."""
    ex = run.core.executor
    return getattr(ex, "inner", ex)
