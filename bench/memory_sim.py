"""A trace-driven simulation of serving, no model: where the KV memory goes under each allocator.

Every step (``step_s`` seconds of simulated time):

1. requests whose ``arrival_s`` has passed join the waiting queue (FIFO);
2. admission, first come first served: the head of the queue is admitted while the allocator can hold
   it (a paged allocator keeps ``watermark`` of its blocks free, as vLLM v0 does); the first refusal
   stops admission for this step (no overtaking);
3. every running request, oldest first, grows by one token. When a paged request finds no free block,
   the newest running request is preempted (recompute: its blocks are freed and it goes back to the
   head of the queue, to be re-admitted with its prompt plus the tokens it had generated);
4. the KV memory is accounted (below); 5. requests that have generated their output leave.

Idle time (nothing running or waiting) is skipped and is not a step. Accounting, in slots, for each
running request with ``t`` tokens now, ``f`` tokens when done, holding ``h`` slots::

    token states    t
    reserved        min(h, f) - t       held, and will be filled by this request later
    internal frag.  h - min(h, f)       held, never to be filled (over-reservation, buddy rounding,
                                        the unused tail of a paged request's last block)
    external frag.  the free slots, on a step where the queue's head was refused although the free
                    slots in total would hold its footprint (no hole fits: only the arena has this)
    free            every other free slot

The five add up to the pool's slots on every step; shares are their time averages over the measured
steps (those inside the window: arrivals from ``warmup_frac`` of the trace's span to the last arrival;
the whole run when everything arrives at once). With ``drain=True`` the run goes on past the window
until every request is done, so that the latency covers every request (an overloaded allocator's
backlog included); without it the run stops at the window's end.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagedbench.bench.workloads import Request
from pagedbench.refengine import BlockManager, ContiguousBlockManager
from pagedbench.refengine.errors import OutOfBlocksError


@dataclass(frozen=True, slots=True)
class AllocatorSpec:
    kind: str  # "orca" (contiguous reservations in an arena) or "paged" (refengine.BlockManager)
    block_size: int  # slots per block (1 for the Orca arena: placement at slot granularity)
    policy: str = "max"  # Orca reservation policy: max, pow2, oracle (unused for paged)
    placement: str = "buddy"  # Orca placement: buddy or first_fit (unused for paged)

    @property
    def name(self) -> str:
        if self.kind == "paged":
            return f"paged bs={self.block_size}"
        suffix = "" if self.placement == "buddy" else f", {self.placement}"
        return f"Orca ({self.policy.capitalize()}{suffix})"


@dataclass(frozen=True, slots=True)
class SimConfig:
    kv_slots: int = 15_700  # the KV budget in token slots (OPT-13B on an A100-40GB, vLLM paper)
    max_seq_len: int = 2048
    step_s: float = 0.04  # simulated time one step (one token per running request) stands for
    watermark: float = 0.01  # share of a paged pool's blocks kept free at admission
    warmup_frac: float = 0.1  # the first share of the arrival span is not measured
    drain: bool = True  # run on until every request is done (latency over all of them)


@dataclass(frozen=True, slots=True)
class Shares:
    """Time-averaged shares of the KV pool (they sum to 1)."""

    token_states: float
    reserved: float
    internal_fragmentation: float
    rounding_waste: float  # the part of internal fragmentation that is buddy rounding
    external_fragmentation: float
    free: float


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step's accounting in slots (only kept with ``record_steps=True``)."""

    time_s: float
    token_states: int
    reserved: int
    internal_fragmentation: int
    rounding_waste: int
    external_fragmentation: int
    free: int
    num_running: int
    num_waiting: int


@dataclass(frozen=True, slots=True)
class SimResult:
    allocator: str
    total_slots: int  # slots of the pool (num_blocks x block_size)
    num_steps: int
    num_measured_steps: int
    shares: Shares
    mean_running: float  # requests running at once, averaged over measured steps
    peak_running: int  # over every step
    num_preemptions: int
    num_finished: int
    mean_normalized_latency_s: float | None  # mean of (finish - arrival) / output_len, finished requests
    steps: tuple[StepRecord, ...] = ()


class _Live:
    __slots__ = ("final_len", "generated", "held", "num_tokens", "req", "rounding")

    def __init__(self, req: Request) -> None:
        self.req = req  # the trace's request
        self.final_len = req.prompt_len + req.output_len  # tokens when done
        self.generated = 0  # output tokens so far (kept across a preemption)
        self.num_tokens = 0  # tokens held in KV memory now (0 while waiting)
        self.held = 0  # slots the allocator holds for it now
        self.rounding = 0  # of those, buddy rounding waste


class _Paged:
    def __init__(self, spec: AllocatorSpec, cfg: SimConfig) -> None:
        self.bs = spec.block_size
        self.bm = BlockManager(cfg.kv_slots // self.bs, self.bs)
        self.total = self.bm.num_blocks * self.bs
        self.watermark = math.ceil(cfg.watermark * self.bm.num_blocks)

    def admit(self, r: _Live) -> bool:
        n = r.req.prompt_len + r.generated
        if self.bm.num_free_blocks - -(-n // self.bs) < self.watermark:
            return False
        self.bm.allocate(r.req.request_id, [0] * n)
        r.num_tokens, r.held = n, -(-n // self.bs) * self.bs
        return True

    def grow(self, r: _Live) -> bool:
        try:
            self.bm.append_token(r.req.request_id, 0)
        except OutOfBlocksError:
            return False
        r.num_tokens += 1
        r.held = -(-r.num_tokens // self.bs) * self.bs
        return True

    def release(self, r: _Live) -> None:
        self.bm.free(r.req.request_id)

    def fragmented(self, r: _Live) -> bool:
        return False  # any free block serves any request

    def used_slots(self) -> int:
        return self.bm.num_used_blocks * self.bs


class _Orca:
    def __init__(self, spec: AllocatorSpec, cfg: SimConfig) -> None:
        self.bs = spec.block_size
        self.policy = spec.policy
        self.cbm = ContiguousBlockManager(cfg.kv_slots // self.bs, self.bs, max_seq_len=cfg.max_seq_len,
                                          policy=spec.policy, placement=spec.placement)
        self.total = self.cbm.num_blocks * self.bs

    def _output(self, r: _Live) -> int | None:
        # pow2/oracle reserve by the request's true output; a re-admission never happens (no preemption)
        return None if self.policy == "max" else r.req.output_len

    def admit(self, r: _Live) -> bool:
        n = r.req.prompt_len
        if not self.cbm.can_allocate(n, output_len=self._output(r)):
            return False
        self.cbm.allocate(r.req.request_id, [0] * n, output_len=self._output(r))
        held = self.cbm.held_blocks(r.req.request_id) * self.bs
        r.num_tokens, r.held = n, held
        r.rounding = held - -(-self.cbm.reserved_tokens(r.req.request_id) // self.bs) * self.bs
        return True

    def grow(self, r: _Live) -> bool:
        self.cbm.append_token(r.req.request_id, 0)  # never fails: the reservation holds the output
        r.num_tokens += 1
        return True

    def release(self, r: _Live) -> None:
        self.cbm.free(r.req.request_id)

    def fragmented(self, r: _Live) -> bool:
        need = self.cbm.footprint_blocks(r.req.prompt_len, output_len=self._output(r))
        return self.cbm.num_free_blocks >= need

    def used_slots(self) -> int:
        return self.cbm.num_used_blocks * self.bs


def _check_trace(trace: tuple[Request, ...], cfg: SimConfig, total: int) -> None:
    for r in trace:
        if r.total_len > min(cfg.max_seq_len, total):
            raise ValueError(f"request {r.request_id}: {r.total_len} tokens exceed max_seq_len "
                             f"{cfg.max_seq_len} or the pool's {total} slots")


class _Run:
    """One simulation's mutable state (see the module docstring for the step)."""

    def __init__(self, trace: tuple[Request, ...], spec: AllocatorSpec, cfg: SimConfig,
                 record_steps: bool) -> None:
        self.mem = _Paged(spec, cfg) if spec.kind == "paged" else _Orca(spec, cfg)
        _check_trace(trace, cfg, self.mem.total)
        self.cfg, self.spec, self.record = cfg, spec, record_steps
        self.pending = deque(sorted(trace, key=lambda r: (r.arrival_s, r.request_id)))
        last = self.pending[-1].arrival_s
        self.window = (cfg.warmup_frac * last, last) if last > 0 else (0.0, math.inf)
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.t = 0.0
        self.num_steps = self.num_measured = self.preemptions = self.peak = 0
        self.sums = [0] * 6  # token, reserved, internal, rounding, external, free (slot-steps)
        self.running_sum = 0
        self.latencies: list[float] = []
        self.steps: list[StepRecord] = []

    def _admit(self) -> _Live | None:
        """Admit FCFS; returns the refused head of the queue, if any."""
        while self.waiting:
            r = self.waiting[0]
            if not self.mem.admit(r):
                return r
            self.waiting.popleft()
            self.running.append(r)
        return None

    def _grow(self) -> None:
        i = 0
        while i < len(self.running):
            r = self.running[i]
            while not self.mem.grow(r):  # no free block: preempt the newest (maybe r itself)
                victim = self.running.pop()
                self.mem.release(victim)
                victim.num_tokens = victim.held = 0
                self.waiting.appendleft(victim)
                self.preemptions += 1
                if victim is r:
                    break
            else:
                r.generated += 1
                i += 1

    def _account(self, refused: _Live | None) -> None:
        tok = res = inte = rnd = 0
        for r in self.running:
            t, h = r.num_tokens, r.held
            u = h if h < r.final_len else r.final_len
            tok += t
            res += u - t
            inte += h - u
            rnd += r.rounding
        held = tok + res + inte
        if held != self.mem.used_slots():
            raise AssertionError(f"accounting drift: requests hold {held} slots, the allocator "
                                 f"{self.mem.used_slots()}")
        free = self.mem.total - held
        ext = free if refused is not None and self.mem.fragmented(refused) else 0
        row = (tok, res, inte, rnd, ext, free - ext)
        if self.window[0] <= self.t <= self.window[1]:
            self.num_measured += 1
            self.running_sum += len(self.running)
            self.sums = [a + b for a, b in zip(self.sums, row)]
        if self.record:
            self.steps.append(StepRecord(self.t, *row, len(self.running), len(self.waiting)))

    def _depart(self) -> None:
        done = [r for r in self.running if r.generated >= r.req.output_len]
        for r in done:
            self.mem.release(r)
            self.running.remove(r)
            finish = self.t + self.cfg.step_s
            self.latencies.append((finish - r.req.arrival_s) / r.req.output_len)

    def step(self) -> bool:
        """Run one step; False when the run is over (all done, or past the window without drain)."""
        while self.pending and self.pending[0].arrival_s <= self.t:
            self.waiting.append(_Live(self.pending.popleft()))
        if not self.running and not self.waiting:
            if not self.pending:
                return False
            self.t = self.pending[0].arrival_s  # idle: skip to the next arrival
            return True
        if self.t > self.window[1] and not self.cfg.drain:
            return False
        refused = self._admit()
        if not self.running:
            raise ValueError(f"request {refused.req.request_id} ({refused.final_len} tokens) can never be "
                             f"admitted by {self.spec.name} with {self.mem.total} slots")
        self._grow()
        self._account(refused)
        self.peak = max(self.peak, len(self.running))
        self._depart()
        self.num_steps += 1
        self.t += self.cfg.step_s
        return True

    def result(self) -> SimResult:
        m = max(self.num_measured, 1)
        shares = Shares(*(s / (m * self.mem.total) for s in self.sums))
        lat = sum(self.latencies) / len(self.latencies) if self.latencies else None
        return SimResult(self.spec.name, self.mem.total, self.num_steps, self.num_measured, shares,
                         self.running_sum / m, self.peak, self.preemptions, len(self.latencies), lat,
                         tuple(self.steps))


def simulate(trace: tuple[Request, ...], spec: AllocatorSpec, cfg: SimConfig = SimConfig(), *,
             record_steps: bool = False, on_step: Callable[[], None] | None = None) -> SimResult:
    """Serve ``trace`` with ``spec``'s allocator under ``cfg`` (see the module docstring)."""
    run = _Run(trace, spec, cfg, record_steps)
    while run.step():
        if on_step is not None:
            on_step()
    return run.result()


def sharing_saving(trace: tuple[Request, ...], n: int, block_size: int) -> float:
    """Memory saved by sharing for parallel sampling with ``n`` samples (vLLM paper, Figure 15).

    Each request alone (no memory pressure): its prompt is allocated once and forked ``n - 1`` times
    (:meth:`refengine.BlockManager.fork`); every sample then generates the request's output, one token
    a step. Returns ``1 - (blocks used with sharing) / (blocks n independent copies would use)``, both
    summed over every step of every request (a time average, as in serving).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    shared = independent = 0
    for r in trace:
        blocks_needed = n * -(-r.total_len // block_size)
        bm = BlockManager(blocks_needed, block_size)
        bm.allocate(0, [0] * r.prompt_len)
        for child in range(1, n):
            bm.fork(0, child)
        for step in range(1, r.output_len + 1):
            for s in range(n):
                bm.append_token(s, 0)
            shared += bm.num_used_blocks
            independent += n * -(-(r.prompt_len + step) // block_size)
    return 1.0 - shared / independent
