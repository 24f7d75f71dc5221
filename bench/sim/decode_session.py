"""The fast-forward's runs at a cost of what changes: the running sequences' decode tokens told late.

:class:`~pagedbench.bench.sim.fast_forward.FastForward` serves runs of decode steps, each ending with a
step that finishes, preempts or admits; made one after another they cost a pass over every running
sequence each (its tokens appended, its table grown), while between two runs one sequence changes. A
:class:`DecodeSession` keeps the running sequences lazy from one run to the next, with nothing else
stepping the scheduler in between (paged, no prefix cache, the mixed policy):

- a sequence that joined at session step ``g0`` with ``n0`` tokens has ``n0 + g - g0`` at step ``g``
  (every step appends the filler), and it is told so (its tokens appended, its token times taken from
  the session's step ends) only when it finishes, is preempted, or the session ends;
- the block manager still takes each block on the step and in the place step-by-step simulation takes
  it: a table starts a block on the steps ``g`` with ``(n0 + g - g0 - 1) % block_size == 0``, so the
  sequences are kept in ``block_size`` groups by that residue, each in the running order, and a run's
  takes are one ``append_token_takes`` call with the takers' ids, step by step, each table told its
  tokens up to the one that starts its block (the tokens in between, told late, take nothing). A table
  is told the rest only when the session ends: one freed as it is (a finish, a preemption) leaves the
  block manager's state what it would be had it been told them, since they take no block;
- the first finish comes from a heap of each sequence's last step, the first take the free blocks
  cannot cover from the groups' sizes step by step.

A run's cost is then its steps, its takes and its events. Anything the session does not model ends it
(every sequence told its tokens), and :class:`FastForward` goes on as before.
"""

from __future__ import annotations

import heapq

from pagedbench.bench.sim.admission import admit
from pagedbench.bench.sim.run_clock import clock_steps
from pagedbench.refengine.engine.core import StepShape
from pagedbench.refengine.engine.scheduler import SchedulerOutput
from pagedbench.refengine.engine.sequence import SequenceStatus

_RUNNING = SequenceStatus.RUNNING
MAX_SCAN = 256  # the most steps a run looks ahead for its takes (a run cut short by an arrival wastes them)


class _Member:
    """A running sequence of the session: told its tokens up to session step ``g0`` (``n0`` of them); its
    block manager table holds its tokens up to the last block it took (at least ``n0 - 1``)."""

    __slots__ = ("entry", "g0", "last", "n0", "seq", "sid")

    def __init__(self, seq, g0: int, entry) -> None:
        self.seq = seq
        self.sid = seq.seq_id
        self.g0 = g0
        self.n0 = n = len(seq.token_ids)
        self.entry = entry  # its timing entry (SimRun.timing), None when it is not measured
        self.last = g0 + seq.params.max_tokens - (n - seq.num_prompt_tokens) - 1  # the step that finishes it


class DecodeSession:
    """Runs of decode steps over lazily told running sequences (module docstring)."""

    def __init__(self, ff, run) -> None:
        self.ff = ff
        self.sched, self.bm, self.bs = ff.sched, ff.bm, ff.bs
        self.filler = ff.executor.filler_token
        self.step_time_s = ff.executor.step_time_s
        self.constant_s = getattr(self.step_time_s, "constant_s", None)  # every step's duration, if one
        self.timing = run.timing
        self.g = 0  # session steps served
        self.step_ends: list[float] = []  # each session step's end
        self.members: dict[int, _Member] = {}
        self.groups: list[list[_Member]] = [[] for _ in range(self.bs)]  # by take residue, running order
        self.group_ids: list[list[int]] = [[] for _ in range(self.bs)]  # their seq ids (a step's takes)
        self.lasts: list[tuple[int, int, int]] = []  # heap of (last step, request id, seq id)
        # the takes for the block manager's next append_token_takes call, then the tables told tokens that
        # take no block (append_token_runs): see _flush
        self.ids: list[int] = []
        self.tell_ids: list[int] = []
        self.tell_counts: list[int] = []

    @staticmethod
    def eligible(sched, seq, filler: int) -> bool:
        """Whether ``seq`` is a decode the session models: its next step appends its filler token,
        samples the filler and it ends only at its ``max_tokens``, within the model's length."""
        tokens = seq.token_ids
        n = len(tokens)
        p = seq.params
        return (seq.status is _RUNNING and seq.num_computed_tokens == n - 1 and seq.num_table_tokens == n - 1
                and tokens[-1] == filler and not seq.pending_children and p.n == 1 and filler not in p.stop_token_ids
                and (p.ignore_eos or filler not in sched.stop.eos_token_ids)
                and seq.num_prompt_tokens + p.max_tokens <= sched.stop.max_model_len)

    def start(self) -> bool:
        """Take in every running sequence; False (nothing taken) when one is not eligible."""
        sched, filler = self.sched, self.filler
        if not all(self.eligible(sched, s, filler) for s in sched.running):
            return False
        for s in sched.running:
            self._join(s)
        return True

    def _join(self, seq) -> None:
        m = _Member(seq, self.g, self.timing.get(seq.seq_id))
        self.members[m.sid] = m
        r = (m.g0 - m.n0 + 1) % self.bs
        group = self.groups[r]
        rid = seq.request_id
        i = len(group)
        while i and group[i - 1].seq.request_id > rid:  # a new sequence is most often the newest
            i -= 1
        group.insert(i, m)
        self.group_ids[r].insert(i, m.sid)
        heapq.heappush(self.lasts, (m.last, rid, m.sid))

    def _leave(self, m: _Member) -> None:
        del self.members[m.sid]
        r = (m.g0 - m.n0 + 1) % self.bs
        i = self.groups[r].index(m)
        del self.groups[r][i], self.group_ids[r][i]

    def _tell(self, m: _Member, g: int) -> None:
        """Tell ``m``'s sequence (tokens, counts, token times) the steps before session step ``g``."""
        add = g - m.g0
        seq = m.seq
        if add:
            seq.token_ids += [self.filler] * add
            if m.entry is not None:
                m.entry[2].extend(self.step_ends[m.g0:g])
            m.n0 += add
            m.g0 = g
        seq.num_computed_tokens = seq.num_table_tokens = m.n0 - 1

    def end(self) -> None:
        """Tell every sequence its tokens: the scheduler's state is step-by-step simulation's again."""
        for m in self.members.values():
            self._tell_table(m, self.g)
        self._flush()
        self.members.clear()

    # --- a run ---------------------------------------------------------------------------------------
    def advance(self, run) -> list[int] | None:
        """Serve a run as :meth:`FastForward.advance` does; None (nothing changed) when it cannot."""
        sched, bm, bs = self.sched, self.bm, self.bs
        running = sched.running
        b = len(running)
        if not b or b > sched.max_num_batched_tokens or len(self.members) != b:
            return None
        refused = admits = False
        if sched.waiting:
            head = sched.waiting[0]
            if b + 1 + len(head.pending_children) <= sched.max_num_seqs and b < sched.max_num_batched_tokens:
                refused = not bm.can_allocate(len(head.token_ids), reserve_free_blocks=sched.watermark_blocks)
                admits = not refused
        lasts, members = self.lasts, self.members
        last, _, sid = lasts[0]
        m = members.get(sid)
        while m is None or m.last != last:
            heapq.heappop(lasts)  # a sequence that left
            last, _, sid = lasts[0]
            m = members.get(sid)
        g = self.g
        first_last = last - g  # the run's step that finishes the first ones
        group_ids = self.group_ids
        avail = bm.num_free_blocks
        if admits:  # one step, if its takes are covered
            if len(group_ids[g % bs]) > avail:
                return None
            return self._admitting_step(run, first_last == 0)
        limit = min(first_last, MAX_SCAN)
        j = used = 0
        refused_at = -1  # the step whose takes the free blocks cannot cover (-1: none up to limit)
        while j <= limit:
            t = len(group_ids[(g + j) % bs])
            if used + t > avail:
                refused_at = j
                break
            used += t
            j += 1
        event, k = None, 0
        if refused_at < 0:
            event, k = ("finish", first_last + 1) if limit == first_last else (None, limit + 1)
        elif self._plan_preemption(g + refused_at, avail - used):  # (it may finish some too: first_last)
            event, k = "preempt", refused_at + 1
        else:
            k = refused_at
        if not k:
            return None
        last = k - 1 if event == "preempt" else -1
        if self.constant_s is not None:
            duration = float(self.constant_s)
        else:
            ends = [m.n0 + g - m.g0 for m in map(members.__getitem__, (s.seq_id for s in running))]
            step_s = self.ff.decode_run(tuple(ends))
            duration = lambda j: self.ff.decode_run(tuple(ends[:self.survivors]))(j) if j == last else step_s(j)  # noqa: E731
        step_ends = clock_steps(run, k, duration)
        if len(step_ends) < k:
            event = None  # the run stopped before its last step
        k = len(step_ends)
        self.step_ends += step_ends
        rounds = k - 1 if event == "preempt" else k
        self._takes(g, g + rounds)
        self.g = g + rounds
        used = bm.num_blocks - avail + len(self.ids)  # the most the run's steps hold before the last
        if used > run.peak_used:
            run.peak_used = used
        refusals = rounds if refused else 0
        generated = b * rounds
        done = []
        if event == "preempt":
            generated += self._preempting_step(g + rounds)
            self.g += 1
            refusals += self.refused_last
            run.peak_used = max(run.peak_used, bm.num_used_blocks)
            if first_last == rounds:  # the step's update finishes those it did not preempt
                done = self._finish(run, g + rounds, step_ends[-1])
        elif event == "finish":
            done = self._finish(run, g + rounds - 1, step_ends[-1])
        self._flush()
        if refusals:
            bm.record_refused_allocations(refusals)
        run.generated += generated
        run.num_steps += k
        run.peak = max(run.peak, b)
        return done

    def _takes(self, g0: int, g1: int) -> None:
        """The block manager's takes of session steps ``[g0, g1)``, step by step, in the running order: each
        taker's table is told its tokens up to the one its step appends (the one that starts its block),
        which the block manager counts from the table (kept in ``ids`` until :meth:`_flush`)."""
        ids, group_ids, bs = self.ids, self.group_ids, self.bs
        for g in range(g0, g1):
            ids += group_ids[g % bs]

    def _tell_table(self, m: _Member, g: int) -> None:
        """:meth:`_tell` ``m`` the steps before session step ``g``, and keep the tokens its table has yet to
        be told for :meth:`_flush` (after the takes kept, which are made first: the table's count is then
        the block manager's)."""
        self._tell(m, g)
        if self.ids:
            self._flush()
        c = m.n0 - 1 - self.bm.num_tokens(m.sid)
        if c:
            self.tell_ids.append(m.sid)
            self.tell_counts.append(c)

    def _flush(self) -> None:
        """The block manager told the takes kept, in order, then the tokens kept that take no block."""
        if self.ids:
            self.bm.append_token_takes(self.ids, self.filler)
            self.ids = []
        if self.tell_ids:
            self.bm.append_token_runs(self.tell_ids, self.tell_counts, self.filler)
            self.tell_ids, self.tell_counts = [], []

    def _finish(self, run, g: int, end: float) -> list[int]:
        """Finish the sequences whose last token session step ``g`` sampled (in the running order, as the
        step's update does)."""
        lasts, members = self.lasts, self.members
        finished: list = []
        finishing = []
        while lasts and lasts[0][0] == g:
            _, _, sid = heapq.heappop(lasts)
            m = members.get(sid)
            if m is None or m.last != g:
                continue
            self._tell(m, g + 1)  # (its table is freed as it is: the tokens it was not told take no block)
            self._leave(m)
            finishing.append(m.seq)
        self._flush()  # the step's takes, before the finished ones' blocks are freed
        for seq in finishing:
            self.sched._finish(seq, self.filler, finished)
        running = self.sched.running
        for seq in finished:  # (a few: cheaper than the update's pass over every running sequence)
            running.remove(seq)
        run.core.record_finished(finished, end)
        return [s.seq_id for s in finished]

    # --- preemption ----------------------------------------------------------------------------------
    def _plan_preemption(self, g: int, avail: int) -> bool:
        """As :meth:`FastForward._plan_preemption`, for session step ``g`` with ``avail`` blocks free at
        its start: the victims (newest first), the survivors, and the head refused after it."""
        sched, bs, members = self.sched, self.bs, self.members
        running = sched.running
        end = len(running)
        victims = []
        for m in self.groups[g % bs]:
            if end < len(running) and m.seq.request_id >= running[end].request_id:
                break  # it went already (and every later taker, newer still)
            if avail == 0:
                end -= 1
                v = members[running[end].seq_id]
                victims.append(v)
                avail += -(-(v.n0 + g - v.g0 - 1) // bs)  # the blocks its table holds at the step's start
                if v is m:
                    break
            avail -= 1
        if not end or not victims:
            return False
        refused = 0
        waiting = sched.waiting
        oldest = victims[-1]
        head, tokens = oldest.seq, oldest.n0 + g - oldest.g0
        if waiting and waiting[0].request_id < head.request_id:
            head = waiting[0]
            tokens = len(head.token_ids)
            if len(waiting) > 1 and waiting[1].request_id == head.request_id:
                return False
        if sched.max_num_batched_tokens > end and end + head.seats <= sched.max_num_seqs:
            if -(-tokens // bs) + sched.watermark_blocks <= avail:
                return False  # the step admits it: the scheduler's step
            refused = 1
        self.victims = [v.sid for v in victims]
        self.survivors = end
        self.refused_last = refused
        return True

    def _preempting_step(self, g: int) -> int:
        """Session step ``g`` as planned: each taker in the running order, and when it finds no free block
        the newest running sequence preempted (told its tokens, then the scheduler's own ``_preempt``).
        Returns how many decoded."""
        sched, bm, members = self.sched, self.bm, self.members
        running = sched.running
        made = []
        avail = bm.num_free_blocks - len(self.ids)
        for m in list(self.groups[g % self.bs]):
            if m.seq.status is not _RUNNING:
                break
            if avail == 0:
                v = members[running[-1].seq_id]
                self._tell(v, g)  # (its table is freed as it is, as a finished one's)
                self._flush()
                self._leave(v)
                sched._preempt(v.seq)
                made.append(v.sid)
                avail = bm.num_free_blocks
                if v is m:
                    break
            self.ids.append(m.sid)
            avail -= 1
        self._flush()
        if made != self.victims:
            raise AssertionError(f"decode session: planned preemptions {self.victims}, made {made}")
        return len(running)

    # --- admission -----------------------------------------------------------------------------------
    def _admitting_step(self, run, finishes: bool) -> list[int]:
        """One step whose decodes' takes are covered and whose admission the scheduler makes (as in
        :meth:`FastForward._admitting_step`); the sequences it admits join the session when eligible,
        else the session ends."""
        sched, bm, clock, filler = self.sched, self.bm, self.ff.clock, self.filler
        running = sched.running
        g = self.g
        b = len(running)
        start = clock.now()
        self._takes(g, g + 1)
        self._flush()
        chunks: list = []
        budget = admit(sched, chunks, sched.max_num_batched_tokens - b)  # (its refused allocation counted)
        sched.peak_running = max(sched.peak_running, len(running))
        run.peak_used = max(run.peak_used, bm.num_used_blocks)
        if self.constant_s is not None:
            clock.advance(self.constant_s)
        else:
            members = self.members
            lens = [m.n0 + g - m.g0 for m in (members[s.seq_id] for s in running if s.seq_id in members)]
            prefill = []
            for c in chunks:
                if c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens:
                    lens.append(c.end)
                else:
                    prefill.append((c.num_tokens, c.end))
            clock.advance(self.step_time_s(StepShape(tuple(prefill), tuple(lens))))
        end = clock.now()
        self.step_ends.append(end)
        self.g = g + 1
        done = self._finish(run, g, end) if finishes else []  # the decodes' finishes come first in the update
        sampled = {}
        for c in chunks:
            if c.samples:
                for s in (c.seq, *c.seq.pending_children):
                    sampled[s.seq_id] = filler
        adm_finished = sched.update(SchedulerOutput(tuple(chunks), (), (), sched.max_num_batched_tokens - budget - b),
                                    sampled)
        run.core.record_finished(adm_finished, end)
        timing = self.timing
        if timing:
            for c in chunks:
                entry = timing.get(c.seq.seq_id)
                if entry is not None:
                    if entry[1] is None:
                        entry[1] = start
                    if c.seq.seq_id in sampled:
                        entry[2].append(end)
        run.generated += b + len(sampled)
        run.num_steps += 1
        run.peak = max(run.peak, len(running) + len(done) + len(adm_finished))
        for c in chunks:
            s = c.seq
            if s.seq_id not in self.members and s.status is _RUNNING and self.eligible(sched, s, filler):
                self._join(s)
        if len(self.members) != len(running):
            self.end()
            self.ff.session = None
        return done + [s.seq_id for s in adm_finished]
