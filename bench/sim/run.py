"""One serving simulation's run: the engine's own loop on a simulated clock, its measured window and its
overload test (:func:`~pagedbench.bench.sim.simulator.simulate` drives it).

**The measured window.** With ``span_s`` set, the trace is the arrivals of a span ``[0, span_s)`` and
the window is ``[warmup_frac * span_s, (1 - cooldown_frac) * span_s]``: latency counts only requests
arriving inside it (:attr:`SimResult.requests`, each with its token times), while the arrivals of the
cool-down keep the load on until they are done. The run ends once every measured request has finished.
Without ``span_s`` the window runs from ``warmup_frac`` of the last arrival to the last arrival (a
trace of a fixed count).

**Overload.** Over the window, ``A`` requests arrive and ``C`` complete; ``A - C`` is how much the
backlog (requests arrived and not finished, waiting or running) grew across the window, and
``C / window`` is the achieved rate against the offered ``A / window``. A stable system's backlog
moves by the noise of its arrivals, about ``sqrt(A)`` for Poisson arrivals; the point is
**overloaded** when ``A - C > overload_z * sqrt(A)`` (default ``overload_z = 3``: three standard
deviations of the arrival count), i.e. the achieved rate is below the offered rate by more than three
times its noise, or equivalently the queue grew across the window. With ``stop_on_overload`` the run
stops as soon as the backlog has grown by twice that allowance inside the window (a six-sigma excursion
for a stable system), or at the window's end if the test fails there: an overloaded point's latency is
the length of the run, not a property of the system, and is never used as a capacity.

With ``drain=True`` the run goes on until every request is done, so that the latency covers every request.

**Follow-ups.** A request with ``release_after`` (a conversation's next turn) arrives ``think_s`` after
that request completes (:mod:`pagedbench.bench.sim.follow_ups`); its arrival depends on the run, so a
trace holding follow-ups is measured whole (the window is every arrival, no overload test, no
``span_s``).

**Swap preemption** (``cfg.preemption_mode="swap"``, paged only): the scheduler swaps victims to a host
pool of ``cfg.swap_blocks`` blocks and back; a step-time function with ``block_copy_s`` (see
:mod:`pagedbench.bench.costmodel.host_link`) prices each step's copies, added to that step
(:mod:`pagedbench.bench.sim.accounting`). Runs of decode steps are not fast-forwarded then (the
fast-forward preempts by recompute).

**The prefix cache's host tier** (``cfg.offload_blocks``, paged with prefix caching only): the block
manager is built with ``num_host_blocks`` as the engine's ``LLM(kv_offloading_size=...)`` builds it;
evicted cached blocks are stored to the tier and later hits loaded back instead of computed. The same
``block_copy_s`` prices each step's stores (as device -> host copies) and loads (host -> device), in a
batch of their own after the swaps' (the engine's executor applies each kind in one batch), added to
that step. Runs of decode steps are not fast-forwarded then (a decode step's new block may evict a cached
one, a store the fast-forward does not plan).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable

from pagedbench.bench.common.serving_metrics import RequestTiming
from pagedbench.bench.sim.accounting import AccountingExecutor
from pagedbench.bench.sim.fast_forward import FastForward
from pagedbench.bench.sim.follow_ups import FollowUps
from pagedbench.bench.sim.group_replay import BeamReplay, GroupSpec, PerBeamContiguousManager, RowExecutor
from pagedbench.bench.sim.records import AllocatorSpec, Overload, Shares, SimConfig, SimResult, StepRecord
from pagedbench.bench.workloads import Request
from pagedbench.refengine import BlockManager, ContiguousBlockManager, SamplingParams
from pagedbench.refengine.engine.core import EngineCore, SimClock, SimulatedExecutor, StepShape
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule


def default_manager(spec: AllocatorSpec, cfg: SimConfig, group: GroupSpec | None = None):
    """The KV manager ``spec`` names, sized to ``cfg.kv_slots`` (a beam group on Orca: one reservation per beam)."""
    if spec.kind == "paged":
        if cfg.num_offload_blocks:  # the engine's kv_offloading_size, in blocks (LLM builds it the same way)
            return BlockManager(cfg.kv_slots // spec.block_size, spec.block_size,
                                enable_prefix_caching=cfg.enable_prefix_caching, num_host_blocks=cfg.num_offload_blocks)
        return BlockManager(cfg.kv_slots // spec.block_size, spec.block_size,
                            enable_prefix_caching=cfg.enable_prefix_caching)
    if spec.kind == "orca":
        # beams fork on Orca too: into a reservation of their own (bench.sim.group_replay)
        cls = PerBeamContiguousManager if group is not None and group.is_beam else ContiguousBlockManager
        return cls(cfg.kv_slots // spec.block_size, spec.block_size,
                                      max_seq_len=cfg.max_seq_len, policy=spec.policy, placement=spec.placement)
    raise ValueError(f"allocator kind must be 'paged' or 'orca', got {spec.kind!r}")


def check_trace(trace: tuple[Request, ...], cfg: SimConfig, total: int, bm, width: int = 1) -> None:
    """Raises ValueError for a request that could never be served: past ``max_seq_len``, more tokens than
    the pool holds, or a group of ``width`` sequences that can never fit it together."""
    footprint = getattr(bm, "footprint_blocks", None)
    for r in trace:
        if r.total_len > cfg.max_seq_len:
            raise ValueError(f"request {r.request_id}: {r.total_len} tokens exceed max_seq_len {cfg.max_seq_len}")
        if r.total_len - 1 > total:  # the last sampled token is never stored
            raise ValueError(f"request {r.request_id}: stores {r.total_len - 1} tokens, more than the pool's "
                             f"{total} slots")
        if width > 1:  # recomputed after a preemption, a group's sequences share nothing
            per_seq = (footprint(r.prompt_len, output_len=r.output_len) if footprint is not None
                       else -(-(r.total_len - 1) // bm.block_size))
            if width * per_seq > bm.num_blocks:
                raise ValueError(f"request {r.request_id}: {width} sequences of {per_seq} blocks each can never fit "
                                 f"the pool's {bm.num_blocks} blocks")


class SimRun:
    """One simulation's state: the engine core on a simulated clock, the pending arrivals, the measured
    requests' timing and the overload test (the module docstring). ``simulate`` calls :meth:`step` until it
    returns False, then :meth:`result`."""

    def __init__(self, trace: tuple[Request, ...], spec: AllocatorSpec, cfg: SimConfig,
                 step_time_s: Callable[[StepShape], float], record_steps: bool, account: bool,
                 prompt_tokens: Callable[[Request], list[int]] | None,
                 make_manager: Callable[[AllocatorSpec, SimConfig], object] | None = None,
                 fast_forward: bool = False, group: GroupSpec | None = None) -> None:
        group = group if group is not None and group.kind != "sample" else None
        self.group = group
        if group is not None and account and spec.kind == "paged":
            raise ValueError("the memory accounting counts each sequence's blocks, which double-counts the "
                             "blocks a group shares: simulate a group with account=False")
        if cfg.num_offload_blocks and spec.kind != "paged":
            raise ValueError(f"offload_blocks (the prefix cache's host tier) needs the paged manager, got {spec.name}")
        self.bm = make_manager(spec, cfg) if make_manager else default_manager(spec, cfg, group)
        if bool(cfg.num_offload_blocks) != (getattr(self.bm, "host_tier", None) is not None):
            raise ValueError(f"offload_blocks={cfg.offload_blocks} but the KV manager make_manager built "
                             f"{'has no' if cfg.num_offload_blocks else 'has a'} host tier")
        self.bs = spec.block_size
        self.total = self.bm.num_blocks * self.bs
        check_trace(trace, cfg, self.total, self.bm, group.width if group else 1)
        self.spec, self.cfg, self.record = spec, cfg, record_steps
        watermark = math.ceil(cfg.watermark * self.bm.num_blocks) if spec.kind == "paged" else 0
        host = None
        if cfg.preemption_mode == "swap":
            if spec.kind != "paged":
                raise ValueError(f"swap preemption needs the paged manager, got {spec.name}")
            from pagedbench.refengine.kv.host_pool import HostBlockAllocator

            host = HostBlockAllocator(cfg.swap_blocks)
        self.sched = Scheduler(self.bm, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.token_budget,
                               stop=StopRule(frozenset(), cfg.max_seq_len), policy=cfg.policy,
                               prefix_caching=cfg.enable_prefix_caching, watermark_blocks=watermark,
                               preemption_mode=cfg.preemption_mode, host_allocator=host)
        # a step-time function may price the host copies of swap preemption (bench.costmodel.host_link)
        self.block_copy_s = getattr(step_time_s, "block_copy_s", None)
        self.copy_s = 0.0
        self.copies: list = []  # CopyRecord of each step that copies blocks to or from the host
        # with a host tier: seq id -> prompt tokens loaded from it at the sequence's first admission
        self.host_hits: dict | None = {} if cfg.num_offload_blocks else None
        executor = SimulatedExecutor(step_time_s)
        # a step-time function may price waking an idle engine (bench.costmodel.wake_cost): the i-th step
        # after an idle jump of the clock costs wake_s(the jump)[i] more
        self.wake_s = getattr(step_time_s, "wake_s", None)
        self.wake_left: list[float] = []  # the extra seconds of the next steps, the next one last
        # and may price the first decode steps after each prefill (bench.costmodel.after_prefill)
        after = getattr(step_time_s, "after_prefill_s", None)
        self.after_prefill = after.tracker() if after is not None else None
        if group is not None and group.is_beam:
            executor = RowExecutor(executor)
        self.clock = SimClock()
        self.core = EngineCore(self.sched, AccountingExecutor(executor, self, account),
                               clock=self.clock, can_fork=spec.kind == "paged")
        self.beams = BeamReplay(self.core, group) if group is not None and group.is_beam else None
        follow = FollowUps(trace)
        self.follow = follow if follow else None
        self.pending = deque(sorted(follow.initial, key=_arrival_order))
        last = self.pending[-1].arrival_s if self.pending else 0.0
        if self.follow is not None:
            if cfg.span_s is not None:
                raise ValueError("a trace with follow-ups is measured whole: span_s must be None")
            self.window = (0.0, math.inf)
        elif cfg.span_s is not None:
            if last >= cfg.span_s:
                raise ValueError(f"the trace's last arrival ({last} s) is past its span_s ({cfg.span_s} s)")
            self.window = (cfg.warmup_frac * cfg.span_s, (1 - cfg.cooldown_frac) * cfg.span_s)
        else:
            self.window = (cfg.warmup_frac * last, last) if last > 0 else (0.0, math.inf)
        w0, w1 = self.window
        # requests measured: arrived inside the window; entry: [request, first scheduled, token times]
        self.num_window_arrivals = sum(w0 <= r.arrival_s <= w1 for r in trace)
        self.allowance = cfg.overload_z * math.sqrt(max(self.num_window_arrivals, 1))
        self.timing: dict[int, list] = {}
        self.num_measured_left = self.num_window_arrivals
        self.arrived_in_window = self.completed_in_window = 0
        self.overloaded = self.stopped_early = False
        self.window_closed = math.isinf(w1)
        self.peak_used = 0
        self.prompt_tokens = prompt_tokens or (lambda r: [0] * r.prompt_len)
        self.check_prompts = prompt_tokens is not None  # a caller's prompts are checked, not its own zeros
        self.params: dict[int, SamplingParams] = {}  # by output length
        self.requests: list[tuple[Request, object]] = []
        self.num_steps = self.num_measured = self.peak = self.generated = 0
        self.sums = [0] * 6  # token, reserved, internal, rounding, external, free (slot-steps)
        self.running_sum = 0
        self.steps: list[StepRecord] = []
        # a run of steps is priced by shape alone: with a price of waking or of a prefill's aftermath,
        # every step is simulated
        fast = (fast_forward and group is None and not account and not record_steps and self.wake_s is None
                and self.after_prefill is None and cfg.preemption_mode == "recompute" and not cfg.num_offload_blocks
                and FastForward.applies(self))
        self.fast = FastForward(self) if fast else None
        self.chain_runs = True  # step() serves runs one after another (False: one per call, for on_step)

    def _arrive(self) -> None:
        now, core = self.clock.now(), self.core
        while self.pending and self.pending[0].arrival_s <= now:
            r = self.pending.popleft()
            params = self.params.get(r.output_len)
            if params is None:  # (frozen: requests of one output length share theirs)
                n = self.group.width if self.group is not None else 1
                params = self.params[r.output_len] = SamplingParams(max_tokens=r.output_len, ignore_eos=True, n=n)
            req = core.new_request(self.prompt_tokens(r), params, arrival_s=r.arrival_s,
                                   check_tokens=self.check_prompts)
            core.add(req)
            if self.beams is not None:
                self.beams.add(req)
            self.requests.append((r, req))
            if self.follow is not None:
                self.follow.watch(req.children[0].seq_id if self.group is None else req.request_id, r)
            if self.window[0] <= r.arrival_s <= self.window[1]:
                self.arrived_in_window += 1
                # a group is timed as a whole, by request id (a beam may be pruned, a sample finish early)
                key = req.children[0].seq_id if self.group is None else req.request_id
                self.timing[key] = [r, None, [], req]

    def step(self) -> bool:
        """Run one step; False when the run is over (all done, or past the window without drain)."""
        self._arrive()
        core = self.core
        if not core.has_unfinished():
            if not self.pending:
                return False
            arrival = self.pending[0].arrival_s
            if self.wake_s is not None:  # the loop picks the arrival up that much later, and its steps run slower
                gap = arrival - self.clock.now()
                self.wake_left = list(reversed(self.wake_s(gap)))
                arrival += self.wake_s.pickup(gap)
            self.clock.advance_to(arrival)  # idle: skip to the next arrival
            return True
        if self.clock.now() > self.window[1] and not self.cfg.drain and self.cfg.span_s is None:
            return False
        fast = self.fast
        if fast is not None:  # a run of decode steps at once
            done = fast.advance(self)
            clock, sched, pending, w1 = self.clock, self.sched, self.pending, self.window[1]
            watch = self.cfg.stop_on_overload  # (the overload test reads the arrivals then)
            ends = not self.cfg.drain and self.cfg.span_s is None  # a step past the window ends the run
            while done is not None:
                now = clock.now()
                # the overload test changes nothing for a run that completed nothing, inside the window
                if (done or watch or now > w1) and not self._count(now, done):
                    return False
                if not self.chain_runs:
                    return True
                # the next call's start, made here (a run after a run, the commonest by far)
                if pending and pending[0].arrival_s <= now:
                    self._arrive()
                if not (sched.waiting or sched.running):
                    return True
                if now > w1 and ends:
                    return False
                done = fast.advance(self)
        try:
            report = core.step()
        except RuntimeError as e:  # the scheduler could not place the head of the queue at all
            head = self.sched.waiting[0] if self.sched.waiting else None
            raise ValueError(f"request {head and head.request_id} can never be admitted by {self.spec.name} "
                             f"with {self.total} slots: {e}") from None
        self.generated += len(report.sampled)
        self.peak = max(self.peak, len(self.sched.running) + len(report.finished))
        self.num_steps += 1
        if self.group is None:
            return self._observe(report, [seq.seq_id for seq in report.finished])
        return self._observe(report, self._observe_group(report))

    def _observe_group(self, report) -> list[int]:
        """A group step's token times (a request's k-th token is out once every sample has k tokens, or
        once its beams advanced k rounds) and the ids of the requests it completed."""
        if self.beams is not None:
            before = self.beams.num_generated
            done = [req.request_id for req in self.beams.after_step(report)]
            self.generated += self.beams.num_generated - before
        else:
            requests = self.core.requests
            done = list(dict.fromkeys(seq.request_id for seq in report.finished if seq.request_id not in requests))
        timing, seen = self.timing, set()
        for c in report.output.chunks:
            rid = c.seq.request_id
            entry = timing.get(rid)
            if entry is None or rid in seen:
                continue
            seen.add(rid)
            if entry[1] is None:
                entry[1] = report.start_s
            children = entry[3].children
            out = (max(s.num_output_tokens for s in children) if self.beams is not None
                   else min(s.num_output_tokens for s in children))
            times = entry[2]
            while len(times) < out:
                times.append(report.end_s)
        return done

    def _observe(self, report, done: list[int]) -> bool:
        """Token times of the measured requests and the overload test; False when the run may stop.
        ``done``: the timing keys (sequence ids, or request ids for groups) of what completed."""
        timing = self.timing
        if timing and self.group is None:
            for c in report.output.chunks:
                entry = timing.get(c.seq.seq_id)
                if entry is not None and entry[1] is None:
                    entry[1] = report.start_s
            for seq_id in report.sampled:
                entry = timing.get(seq_id)
                if entry is not None:
                    entry[2].append(report.end_s)
        return self._count(report.end_s, done)

    def _count(self, end: float, done: list[int]) -> bool:
        """The overload test after a step ending at ``end`` that completed ``done`` (timing keys); False
        when the run may stop. With nothing completed it changes nothing unless requests arrived since the
        last call or the step is the first to end past the window (a fast-forwarded run ends there)."""
        w0, w1 = self.window
        timing = self.timing
        if self.follow is not None and done:  # the turns these completions release
            for r in self.follow.release(done, end):
                bisect.insort(self.pending, r, key=_arrival_order)
        for key in done:
            if key in timing:
                self.num_measured_left -= 1
        if w0 <= end <= w1:
            self.completed_in_window += len(done)
            if (self.cfg.stop_on_overload
                    and self.arrived_in_window - self.completed_in_window > 2 * self.allowance):
                self.overloaded = self.stopped_early = True
                return False
        elif end > w1 and not self.window_closed:
            self.window_closed = True
            self.overloaded = self.num_window_arrivals - self.completed_in_window > self.allowance
            if self.overloaded and self.cfg.stop_on_overload:
                self.stopped_early = self.num_measured_left > 0
                return False
        # with a span, the run is over once every measured request is done (the cool-down's need not be)
        return not (self.cfg.span_s is not None and self.window_closed and self.num_measured_left == 0)

    def result(self) -> SimResult:
        if self.fast is not None:
            self.fast.end_session()
        m = max(self.num_measured, 1)
        shares = Shares(*(s / (m * self.total) for s in self.sums))
        lat = [(end - r.arrival_s, r.output_len) for r, req in self.requests if (end := req.finish_s) is not None]
        norm = sum(d / n for d, n in lat) / len(lat) if lat else None
        w0, w1 = self.window
        overload = None
        if w1 > w0 and not math.isinf(w1):
            if not self.window_closed:  # the run ended inside the window (idle, nothing left to arrive)
                self.overloaded |= self.num_window_arrivals - self.completed_in_window > self.allowance
            until = min(self.clock.now(), w1) if self.stopped_early else w1
            arrivals = self.arrived_in_window if self.stopped_early else self.num_window_arrivals
            overload = Overload(self.window, until, arrivals, self.completed_in_window, self.allowance,
                                self.overloaded, self.stopped_early)
        timings = tuple(RequestTiming(r.request_id, r.arrival_s, r.prompt_len, r.output_len, first, tuple(times))
                        for r, first, times, _ in self.timing.values())
        return SimResult(self.spec.name, self.total, self.num_steps, self.num_measured, shares,
                         self.running_sum / m, self.peak, self.sched.num_preemptions, len(lat), norm,
                         self.clock.now(), self.generated, tuple(self.steps), tuple(d for d, _ in lat),
                         timings, overload, self.peak_used * self.bs, self.copy_s,
                         self.sched.num_swapped_out_blocks, self.sched.num_swapped_in_blocks, tuple(self.copies),
                         tuple((r.request_id, c) for r, req in self.requests
                               if (c := req.children[0].num_cached_tokens) is not None),
                         *self._prefix_counters())

    def _prefix_counters(self) -> tuple:
        """SimResult's prefix-cache counters and host-tier copies, in its field order (zeros without a prefix cache)."""
        m = self.bm.metrics() if self.cfg.enable_prefix_caching and self.spec.kind == "paged" else None
        if m is None:
            return 0, 0, 0, 0, 0, ()
        host = ()
        if self.host_hits is not None:
            hits = self.host_hits
            host = tuple((r.request_id, hits.get(req.children[0].seq_id, 0)) for r, req in self.requests
                         if req.children[0].num_cached_tokens is not None)
        return (m.prefix_hit_tokens, m.prefix_host_hit_tokens, m.prefix_computed_tokens, m.host_stored_blocks,
                m.host_loaded_blocks, host)


def _arrival_order(r: Request) -> tuple[float, int]:
    return (r.arrival_s, r.request_id)
