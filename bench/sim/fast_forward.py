"""Runs of decode steps served in one go, with the schedule step-by-step simulation would make.

Between two events that can change a schedule, every step of a simulation is the same: each running
sequence computes its last token and samples the next one. The events are an arrival, a finish, a
preemption (an append with no free block), an admission and a prefill chunk. :meth:`FastForward.advance`
finds how many such steps can pass before the first event, applies them at once, and serves the
event's own step too when it is a finish, a preemption or an admission (``event``):

- the clock moves step by step as before (each step's duration is ``step_time_s`` of that step's
  :class:`StepShape`, or the same float from the step-time function's own ``decode_run``, see
  :func:`decode_run_of`; added in the same order, so every timestamp is the same float), and the run stops
  before the first step that would start at or after the next arrival when the queue is empty (behind
  a head that cannot be admitted an arrival only queues, at the step it would), or past the window
  without drain, and after a step the overload test of a step-by-step run would look at (one ending
  past the window; with ``stop_on_overload`` one an arrival preceded: see :func:`clock_steps`);
- no sequence finishes before the run's last step; when the first ones finish there (FINISH), the
  step's update is the scheduler's (``Scheduler._finish`` in the running order, their blocks freed);
- the run's appends are covered by free blocks (paged) or by the reservations (Orca), so none preempts
  before its last step; there (PREEMPT, paged without a prefix cache) the step's decodes preempt the
  newest running sequences as the scheduler's would (``_plan_preemption`` counts them in advance,
  ``_preempting_step`` makes them with ``Scheduler._preempt``), if the queue's head is then refused;
- the queue's head cannot be admitted on any of its steps: the queue is empty, the seats are taken
  (nothing frees one inside the run), in the mixed policy the decodes use the whole token budget, or
  the manager refuses it now (``can_allocate``; with prefix caching ``allocation_preview``, hits
  counted): free blocks only get fewer inside the run and an eviction only loses hits, so it is refused
  on every step, unless the run publishes the block its hits would go on with (the run ends at that
  step, see ``_bound_by_new_hits``); the manager counts one refused ``allocate`` per step
  (``record_refused_allocations``). A head the manager would take now (mixed policy) makes a run of one
  step (ADMIT): its decodes' appends, then the scheduler's own ``_admit`` and ``update`` of what it
  admitted (``_admitting_step``);
- the block manager's calls leave the state the steps would leave: one ``append_token_rounds`` call
  (paged: the block manager takes the run's blocks round by round, within a round in the running
  order, and with prefix caching publishes after each round the blocks it filled, as the steps'
  ``append_token`` calls and the scheduler's ``publish_blocks`` after each step would); one
  ``append_tokens`` call per sequence (Orca: its reservation covers the run). Eviction, publication
  and block ids are those of step-by-step simulation.

Paged without a prefix cache and with the mixed policy, the runs go through a
:class:`~pagedbench.bench.sim.decode_session.DecodeSession`, which keeps the running sequences' tokens
lazy from one run to the next, so that a run costs its steps, takes and events rather than a pass over
the batch; it hands back to the plain runs here whenever it does not model a step.

Anything else (a prefill chunk, a sequence of a parallel-sampling request, an executor replaying real
tokens, a stop token equal to the filler) falls back to one real step. The simulator's memory
accounting reads every step, so runs with ``account=True`` or ``record_steps=True`` are never skipped.
"""

from __future__ import annotations

import math
import operator

from pagedbench.bench.sim.admission import admit
from pagedbench.bench.sim.decode_session import DecodeSession
from pagedbench.bench.sim.run_clock import clock_steps, decode_run_of
from pagedbench.refengine.engine.core import SimulatedExecutor, StepShape
from pagedbench.refengine.engine.scheduler import SchedulerOutput
from pagedbench.refengine.engine.sequence import SequenceStatus

_SEQ_ID = operator.attrgetter("seq_id")
_FINISHED, _RUNNING = SequenceStatus.FINISHED, SequenceStatus.RUNNING
FINISH, PREEMPT, ADMIT = "finish", "preempt", "admit"  # what a run's last step does besides decoding
MIN_RUN = 1  # the fewest steps a run takes: even one decode step costs less as a run than as a real step


class FastForward:
    """Advances a serving simulation's run (:class:`~pagedbench.bench.sim.run.SimRun`) over runs of decode steps."""

    __slots__ = ("bm", "bs", "clock", "decode_run", "event", "executor", "finishers", "held", "hit_blocks", "lazy",
                 "paged", "refused", "refused_last", "sched", "session", "survivors", "victims")

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
        # what the run's last step does besides decoding (set by _bound): None, FINISH (self.finishers
        # sample their last token) or PREEMPT (self.victims, positions in the running order, are preempted,
        # the first self.survivors decode, and the step tries and fails to admit the queue's head
        # refused_last times)
        self.event = None
        self.finishers: list = []
        self.victims: list[int] = []
        self.survivors = 0
        self.refused_last = 0
        sched = self.sched
        self.lazy = self.paged and not sched.prefix_caching and sched.policy == "mixed"
        self.session = None

    def end_session(self) -> None:
        """Tell the running sequences every token a session kept from them (the state step-by-step
        simulation has); call before anything else reads them."""
        if self.session is not None:
            self.session.end()
            self.session = None

    @staticmethod
    def applies(run) -> bool:
        """Whether the run's executor is the simulated one with filler tokens (the only one it models)."""
        ex = _simulated(run)
        return type(ex) is SimulatedExecutor and ex.replay is None

    def advance(self, run) -> list[int] | None:
        """Serve a run of at least ``MIN_RUN`` decode steps and return the ids of the sequences its last
        step finished (often none), or change nothing and return None."""
        if self.lazy:  # runs at the cost of what changes (sim_decode_session), while it models them
            if self.session is None:
                session = DecodeSession(self, run)
                if session.start():
                    self.session = session
            if self.session is not None:
                done = self.session.advance(run)
                if done is not None:
                    return done
                self.end_session()
        k_max = self._bound(run)
        if k_max < MIN_RUN:
            return None
        if self.event is ADMIT:
            return self._admitting_step(run)
        sched = self.sched
        running = sched.running
        b = len(running)
        ends = [a + 1 for a in self.held]  # each decode chunk's end (its context) at the run's start
        step_s = self.decode_run(tuple(ends))  # step j's duration
        event = self.event
        last = k_max - 1 if event is PREEMPT else -1  # the preempting step (fewer decode)
        # (the preempting step's duration asked for in its turn: a step-time function may watch the order)
        step_ends = clock_steps(run, k_max, lambda k: self.decode_run(tuple(ends[:self.survivors]))(k)
                                if k == last else step_s(k))
        k = len(step_ends)
        if k < k_max:
            event = None  # the run stopped before its last step
        rounds = k - 1 if event is PREEMPT else k  # steps every running sequence decodes
        self._apply(running, ends, rounds)
        # what the step-by-step run observes per step: the measured requests' token times, and the pool's
        # peak use (the steps only take blocks until the last one's preemptions or finishes)
        timing = run.timing
        if timing:
            decoded = step_ends[:rounds] if rounds < k else step_ends
            for entry in map(timing.get, map(_SEQ_ID, running)):
                if entry is not None:
                    entry[2].extend(decoded)
        if self.bm.num_used_blocks > run.peak_used:
            run.peak_used = self.bm.num_used_blocks
        refusals = rounds if self.refused is not None else 0
        generated = b * rounds
        done = []
        if event is PREEMPT:
            generated += self._preempting_step(running)
            refusals += self.refused_last
            run.peak_used = max(run.peak_used, self.bm.num_used_blocks)
            if timing:
                for entry in map(timing.get, map(_SEQ_ID, running)):
                    if entry is not None:
                        entry[2].append(step_ends[-1])
        elif event is FINISH:
            finished = []
            filler = self.executor.filler_token
            for s in self.finishers:  # in the running order, as the step's update finishes them
                sched._finish(s, filler, finished)
            running[:] = [s for s in running if s.status is not _FINISHED]
            run.core.record_finished(finished, step_ends[-1])
            done = [s.seq_id for s in finished]
        if refusals:  # each of those steps tried to admit the queue's head, and was refused
            self.bm.record_refused_allocations(refusals)
        run.generated += generated
        run.num_steps += k
        run.peak = max(run.peak, b)
        return done

    def _bound(self, run) -> int:
        """The most steps that can pass with no admission, nor a preemption or finish before the last
        one (0: none); sets ``event`` and what it needs for the last step."""
        sched = self.sched
        running = sched.running
        b = len(running)
        self.refused = None
        self.event = None
        admits = False
        if not b or b > sched.max_num_batched_tokens:
            return 0
        # a queue's head that could be admitted ends the run before it starts: tested first, before the
        # pass over the running sequences (b seats is a lower bound on theirs: the pass checks it)
        if sched.waiting:
            head = sched.waiting[0]
            seats_full = b + head.seats > sched.max_num_seqs
            no_budget = sched.policy == "mixed" and b == sched.max_num_batched_tokens
            if not (seats_full or no_budget):
                if self._refuses_now(head):
                    self.refused = head
                elif sched.policy == "mixed":  # the step's admission follows its decodes: see _admitting_step
                    admits = True
                else:
                    return 0
        filler = self.executor.filler_token
        eos = sched.stop.eos_token_ids
        longest = 0
        self.held = held = []  # tokens each sequence's table holds at the run's start
        lefts = []  # steps before the one that samples each sequence's last token (and finishes it)
        for s in running:  # once per running sequence per run: attributes read inline
            tokens = s.token_ids
            n = len(tokens)
            if (s.num_computed_tokens != n - 1 or s.num_table_tokens != n - 1 or tokens[-1] != filler
                    or s.pending_children):
                return 0
            p = s.params
            if p.n != 1 or filler in p.stop_token_ids or (not p.ignore_eos and filler in eos):
                return 0
            lefts.append(p.max_tokens - (n - s.num_prompt_tokens) - 1)
            if n > longest:
                longest = n
            held.append(n - 1)
        k_len = sched.stop.max_model_len - longest  # no sequence outgrows the model inside the run
        first_finish = min(lefts)  # the step that finishes the first ones
        if self.paged:
            first_take_refused = self._bound_by_free_blocks(held, math.inf)  # the step that would preempt
        else:  # the reservations cover this many steps
            bm = self.bm
            first_take_refused = min(bm.reserved_tokens(s.seq_id) - a for s, a in zip(running, held))
        if admits:  # one step, whose decodes take no block they would have to preempt for
            if first_take_refused < 1 or k_len < 1:
                return 0
            self.event = ADMIT
            self.finishers = [s for s, left in zip(running, lefts) if left == 0]
            return 1
        k = min(k_len, first_finish, first_take_refused)
        if first_finish < first_take_refused and first_finish < k_len:
            self.event, k = FINISH, first_finish + 1  # the run ends with the step that finishes them
        elif (self.paged and not sched.prefix_caching and first_take_refused < min(first_finish, k_len)
              and self._plan_preemption(held, first_take_refused)):
            self.event, k = PREEMPT, first_take_refused + 1
        if self.refused is not None and self.hit_blocks is not None:
            cut = self._bound_by_new_hits(held, k)
            if cut < k:
                self.event, k = None, cut
        if self.event is FINISH:
            self.finishers = [s for s, left in zip(running, lefts) if left == first_finish]
        return k

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

    def _plan_preemption(self, held: list[int], step: int) -> bool:
        """Whether step ``step`` of the run, the first whose takes the free blocks cannot cover, can end
        the run: it preempts (``victims``: the newest running sequences, as the scheduler's decodes free
        them one at a time, each when a take finds no free block) and admits nobody (the queue's head
        after it is refused, or not tried); sets ``victims``, ``survivors`` and ``refused_last``.
        Without a prefix cache only (the head's hits would need a lookup)."""
        sched, bs = self.sched, self.bs
        running = sched.running
        # the free blocks at the step's start: those of the run's start, less the takes of steps 0..step-1
        avail = self.bm.num_free_blocks
        for a in held:
            first = -a % bs
            if first < step:
                avail -= (step - first + bs - 1) // bs
        victims, end, i = [], len(running), 0  # running[:end] survive
        while i < end:
            if (held[i] + step) % bs == 0:  # its table takes a block on this step
                if avail == 0:  # the newest running sequence goes, and gives back its blocks
                    end -= 1
                    victims.append(end)
                    avail += -(-(held[end] + step) // bs)
                    if end == i:
                        break
                    continue
                avail -= 1
            i += 1
        if not end or not victims:
            return False  # the step would schedule nothing (or the count went wrong: the scheduler's step)
        refused = 0
        if sched.policy == "mixed":  # the admission comes after the decodes, with the victims queued
            waiting = sched.waiting
            head = running[victims[-1]]
            if waiting and waiting[0].priority < head.priority:
                head = waiting[0]
                if len(waiting) > 1 and waiting[1].request_id == head.request_id:
                    return False  # a group of several sequences: the scheduler's own rules
            tokens = len(head.token_ids) + (step if head.status is _RUNNING else 0)
            if sched.max_num_batched_tokens > end and end + head.seats <= sched.max_num_seqs:
                if -(-tokens // bs) + sched.watermark_blocks <= avail:
                    return False  # the step admits it: the scheduler's step
                refused = 1
        elif self.refused is not None:  # the admission came first, refused as on every step of the run
            refused = 1
        self.victims = victims
        self.refused_last = refused
        self.survivors = end
        return True

    def _preempting_step(self, running) -> int:
        """The step ``_plan_preemption`` planned, with the scheduler's own preemptions: the running
        sequences' appends in order, and each take that finds no free block preempting the newest
        (freed before the take retries, as the scheduler's decodes do). Returns how many decoded."""
        sched, bm, bs = self.sched, self.bm, self.bs
        filler = self.executor.filler_token
        avail = bm.num_free_blocks
        done, i = 0, 0  # running[done:i] wait for their appends
        preempted = []
        while i < len(running):
            s = running[i]
            if s.num_table_tokens % bs == 0:
                if avail == 0:
                    if i > done:
                        bm.append_token_rounds([r.seq_id for r in running[done:i]], filler, 1)
                    done = i
                    victim = running[-1]
                    sched._preempt(victim)
                    preempted.append(len(running))
                    avail = bm.num_free_blocks
                    if victim is s:
                        break
                    continue
                avail -= 1
            i += 1
        if len(running) > done:
            bm.append_token_rounds([r.seq_id for r in running[done:]], filler, 1)
        if preempted != self.victims:
            raise AssertionError(f"fast-forward: planned preemptions {self.victims}, made {preempted}")
        for s in running:
            s.token_ids.append(filler)
            s.num_computed_tokens = s.num_table_tokens = len(s.token_ids) - 1
        return len(running)

    def _admitting_step(self, run) -> list[int]:
        """One step whose decodes take no block they would preempt for, and whose admission the
        scheduler makes (``Scheduler._admit``, after the decodes' appends as in its own step: it may
        admit several requests, or be refused); the admitted chunks' update is the scheduler's too.
        The decodes' publications (prefix caching) and finishes come after the admission, in the
        running order, as the step's update makes them. Returns the finished sequences' ids."""
        sched, bm, bs, clock = self.sched, self.bm, self.bs, self.clock
        running = sched.running
        decoders = list(running)
        ends = [a + 1 for a in self.held]
        start = clock.now()
        filler = self.executor.filler_token
        self._apply(decoders, ends, 1, publish=False)
        chunks: list = []
        budget = admit(sched, chunks, sched.max_num_batched_tokens - len(decoders))  # (its refused allocation counted)
        sched.peak_running = max(sched.peak_running, len(running))
        run.peak_used = max(run.peak_used, bm.num_used_blocks)
        lens, prefill = list(ends), []  # the step's shape (StepShape.of: decodes first)
        for c in chunks:
            if c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens:
                lens.append(c.end)
            else:
                prefill.append((c.num_tokens, c.end))
        clock.advance(self.executor.step_time_s(StepShape(tuple(prefill), tuple(lens))))
        end = clock.now()
        finished: list = []
        if sched.prefix_caching:
            finishing = {id(s) for s in self.finishers}
            for s, e in zip(decoders, ends):
                if e % bs == 0:
                    bm.publish_blocks(s.seq_id, e)
                if id(s) in finishing:
                    sched._finish(s, filler, finished)
        else:
            for s in self.finishers:
                sched._finish(s, filler, finished)
        sampled = {}  # what the simulated executor samples for the admitted chunks
        for c in chunks:
            if c.samples:
                for s in (c.seq, *c.seq.pending_children):
                    sampled[s.seq_id] = filler
        if finished:
            running[:] = [s for s in running if s.status is not _FINISHED]
        finished += sched.update(SchedulerOutput(tuple(chunks), (), (), sched.max_num_batched_tokens - budget
                                                 - len(decoders)), sampled)
        run.core.record_finished(finished, end)
        timing = run.timing
        if timing:
            for s in decoders:
                entry = timing.get(s.seq_id)
                if entry is not None:
                    entry[2].append(end)
            for c in chunks:
                entry = timing.get(c.seq.seq_id)
                if entry is not None:
                    if entry[1] is None:
                        entry[1] = start
                    if c.seq.seq_id in sampled:
                        entry[2].append(end)
        run.generated += len(decoders) + len(sampled)
        run.num_steps += 1
        run.peak = max(run.peak, len(running) + len(finished))
        return [s.seq_id for s in finished]

    def _apply(self, running, ends: list[int], k: int, publish: bool = True) -> None:
        """The scheduler's and the block manager's state after ``k`` decode steps (``publish=False``:
        without the publications of the blocks they fill, prefix caching)."""
        filler = self.executor.filler_token
        fill = [filler] * k
        if self.paged:  # each step's takes, then (prefix caching) its publications, as update makes them
            self.bm.append_token_rounds(list(map(_SEQ_ID, running)), filler, k,
                                        publish_full_blocks=publish and self.sched.prefix_caching)
            for s in running:
                s.token_ids.extend(fill)
                s.num_computed_tokens = s.num_table_tokens = len(s.token_ids) - 1
            return
        for s, a, e in zip(running, self.held, ends):
            s.token_ids.extend(fill)
            self.bm.append_tokens(s.seq_id, s.token_ids[a:e - 1 + k])
            s.num_computed_tokens = s.num_table_tokens = e - 1 + k


def _simulated(run):
    """The run's simulated executor, under the wrapper that watches each step's KV memory (whose work a
    run does itself: see ``advance``)."""
    ex = run.core.executor
    return getattr(ex, "inner", ex)
