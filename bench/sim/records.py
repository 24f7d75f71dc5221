"""The serving simulator's inputs and results: which KV manager (:class:`AllocatorSpec`), the serving
setting (:class:`SimConfig`), and what a run measured (:class:`SimResult`, with its pool shares, step
records and overload test). :mod:`pagedbench.bench.sim.simulator` runs them and is where they are imported
from; its docstring says what each measure means.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedbench.bench.common.serving_metrics import RequestTiming


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
    step_s: float = 0.04  # a constant step time, used when simulate() gets no step_time_s
    watermark: float = 0.01  # share of a paged pool's blocks kept free at admission
    warmup_frac: float = 0.1  # the first share of the arrival span is not measured
    drain: bool = True  # run on until every request is done (latency over all of them)
    max_num_seqs: int = 256  # vLLM's default
    # tokens computed per step; large enough by default that admission is limited by memory, not
    # by the budget (a prompt of max_seq_len fits a step)
    max_num_batched_tokens: int | None = None
    policy: str = "mixed"  # "mixed" (chunked prefill, today's vLLM) or "separate" (vLLM v0.1)
    enable_prefix_caching: bool = False
    span_s: float | None = None  # the arrivals' span (None: up to the last arrival); see serving_sim's docstring
    cooldown_frac: float = 0.0  # the last share of the span is not measured (arrivals keep the load on)
    overload_z: float = 3.0  # the overload test's allowance, in standard deviations of the arrival count
    stop_on_overload: bool = False  # stop a run once it is overloaded (its latency is then not reported)
    # "recompute" or "swap" (paged only: victims' blocks go to a host pool of swap_blocks blocks, and come
    # back; the step-time function's block_copy_s prices the copies, see bench.costmodel.host_link)
    preemption_mode: str = "recompute"
    swap_blocks: int = 0
    # the prefix cache's host tier (the engine's kv_offloading_size, counted in blocks): evicted cached
    # blocks are stored to that many host blocks and loaded back on a later hit instead of computed; the
    # step-time function's block_copy_s prices the stores (device -> host) and loads (host -> device).
    # 0 or None: no tier. Paged manager with prefix caching only
    offload_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if type(self.swap_blocks) is not int or self.swap_blocks < 0:
            raise ValueError(f"swap_blocks must be an int >= 0, got {self.swap_blocks!r}")
        if self.offload_blocks is not None and (type(self.offload_blocks) is not int or self.offload_blocks < 0):
            raise ValueError(f"offload_blocks must be an int >= 0 (or None), got {self.offload_blocks!r}")
        if self.offload_blocks and not self.enable_prefix_caching:
            raise ValueError(f"offload_blocks={self.offload_blocks} is a host tier of the prefix cache: it needs "
                             "enable_prefix_caching=True")
        if self.span_s is not None and not self.span_s > 0:
            raise ValueError(f"span_s must be > 0 seconds (or None), got {self.span_s}")
        if not (self.warmup_frac >= 0 and self.cooldown_frac >= 0 and self.warmup_frac + self.cooldown_frac < 1):
            raise ValueError(f"warmup_frac and cooldown_frac must be >= 0 and leave a window (sum < 1), got "
                             f"{self.warmup_frac} and {self.cooldown_frac}")

    @property
    def num_offload_blocks(self) -> int:
        """The host tier's blocks (0: none)."""
        return self.offload_blocks or 0

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or max(4096, 2 * self.max_seq_len)


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
class CopyRecord:
    """One step's host copies (swap preemption, the prefix cache's host tier): kept for every step that copies."""

    time_s: float  # the step's start
    num_swapped_out: int  # blocks copied device -> host (swap preemption)
    num_swapped_in: int  # blocks copied host -> device (swap preemption)
    copy_s: float  # the seconds they added to the step (0 without a block_copy_s price)
    num_offload_stored: int = 0  # evicted cached blocks copied device -> host (the host tier)
    num_offload_loaded: int = 0  # host-tier hits copied host -> device


@dataclass(frozen=True, slots=True)
class Overload:
    """The overload test over the measured window (:mod:`pagedbench.bench.sim.simulator`'s docstring)."""

    window_s: tuple[float, float]
    measured_until_s: float  # the window's end, or the clock where the run stopped early
    num_arrivals: int  # requests arriving inside the window (A), up to measured_until_s
    num_completions: int  # requests (any arrival) finishing inside the window (C), up to measured_until_s
    allowance: float  # overload_z * sqrt(A): how far the backlog may grow for a stable system
    overloaded: bool  # A - C > allowance (or stopped early)
    stopped_early: bool  # the run stopped before its measured requests finished

    @property
    def backlog_growth(self) -> int:
        return self.num_arrivals - self.num_completions

    @property
    def offered_rate(self) -> float:
        return self.num_arrivals / (self.measured_until_s - self.window_s[0])

    @property
    def achieved_rate(self) -> float:
        return self.num_completions / (self.measured_until_s - self.window_s[0])


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
    simulated_s: float = 0.0  # the clock at the end
    num_generated_tokens: int = 0
    steps: tuple[StepRecord, ...] = ()
    latencies_s: tuple[float, ...] = ()  # end-to-end latency of each finished request, trace order
    requests: tuple[RequestTiming, ...] = ()  # the measured requests (arrived in the window), trace order
    overload: Overload | None = None  # None when the window holds no time (every arrival at once)
    peak_used_slots: int = 0  # the most slots held at once (after a step's allocations)
    copy_s: float = 0.0  # seconds of every step spent on host copies (swap preemption), summed
    num_swapped_out_blocks: int = 0  # blocks copied to the host pool
    num_swapped_in_blocks: int = 0  # blocks copied back
    copies: tuple[CopyRecord, ...] = ()  # the steps that copied blocks to or from the host, in order
    # (trace request id, prompt tokens its first admission found in the prefix cache) of every request admitted
    cached_tokens: tuple[tuple[int, int], ...] = ()
    # the prefix cache's counters over every successful allocation (a preempted request's readmission
    # too), each prompt token in exactly one: found on the device, loaded from the host tier, computed
    prefix_hit_tokens: int = 0
    prefix_host_hit_tokens: int = 0
    prefix_computed_tokens: int = 0
    num_offload_stored_blocks: int = 0  # evicted cached blocks copied to the host tier
    num_offload_loaded_blocks: int = 0  # host-tier hits copied back to the device
    # (trace request id, of its cached_tokens those loaded from the host tier) of every request admitted
    # while a host tier is on (empty without one)
    host_cached_tokens: tuple[tuple[int, int], ...] = ()
