"""``LLM.stats``: a frozen snapshot of the KV pool and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LLMStats:
    """Counters since the LLM was built; pool figures as of now (after a generate: all blocks free)."""

    num_blocks: int  # blocks in the KV pool
    block_size: int  # token slots per block
    num_used_blocks: int  # blocks held by sequences now
    num_free_blocks: int  # free blocks, cached prefix blocks included
    num_cached_blocks: int  # free blocks holding reusable prefix-cache K/V
    peak_used_blocks: int  # most blocks held at the end of any step
    mean_kv_utilisation: float  # mean over steps of token states held / slots in the pool
    mean_used_blocks: float  # mean over steps of blocks the tables hold (a shared block once)
    mean_table_blocks: float  # mean over steps of block-table entries (a shared block once per table)
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache (re-admissions included)
    prefix_hit_tokens: int  # of those, tokens served from the device pool's cache (not computed)
    num_preemptions: int  # sequences preempted, by recompute or by swap (swapped ones are counted too)
    num_steps: int  # engine steps run
    num_requests: int  # requests served
    num_rejected_requests: int  # requests rejected with an error
    num_prompt_tokens: int  # prompt tokens of the served requests
    num_computed_tokens: int  # tokens run through the model (recomputed ones included)
    num_generated_tokens: int  # tokens sampled
    peak_running_seqs: int  # largest running batch
    mean_running_seqs: float  # mean running batch over steps
    # the same two means over the steps that ended with requests still waiting (the pool, not the
    # trace's tail, limits the batch there): the steady state of a loaded server
    mean_running_seqs_queued: float
    mean_kv_utilisation_queued: float
    # wall seconds spent in generate and step calls since construction (the idle time between calls not)
    elapsed_s: float = 0.0
    num_failed_steps: int = 0  # steps that raised and were rolled back (their sequences recompute-preempted)
    # swap preemption (preemption_mode="swap"), counted in groups (a request's sequences go together)
    num_swap_outs: int = 0  # groups swapped to the host pool
    num_swap_ins: int = 0  # groups swapped back to the device
    num_swap_fallbacks: int = 0  # groups the host pool could not take: recompute-preempted instead
    num_swapped_out_blocks: int = 0  # blocks copied device -> host (a shared block once)
    num_swapped_in_blocks: int = 0  # blocks copied host -> device
    # the prefix cache's host tier (kv_offloading_size): never summed into prefix_hit_tokens
    prefix_host_hit_tokens: int = 0  # of prefix_query_tokens, tokens loaded from the host tier (not computed)
    num_host_blocks: int = 0  # blocks of the host tier
    num_host_cached_blocks: int = 0  # host blocks holding an evicted prefix block's KV now
    num_offloaded_blocks: int = 0  # evicted cached blocks copied device -> host
    num_loaded_blocks: int = 0  # host hits copied host -> device
    num_host_evictions: int = 0  # host entries evicted (LRU) to make room

    def __str__(self) -> str:
        """The figures a reader looks for first, throughput included (``repr`` has every field)."""
        return (f"LLMStats({self.num_requests} requests ({self.num_rejected_requests} rejected), "
                f"{self.num_prompt_tokens} prompt + {self.num_generated_tokens} generated tokens in "
                f"{self.elapsed_s:.2f} s over {self.num_steps} steps: input {self.input_tokens_per_s:.1f} tok/s, "
                f"output {self.output_tokens_per_s:.1f} tok/s; KV pool {self.num_blocks} blocks x "
                f"{self.block_size}, peak {self.peak_used_blocks} used, prefix hit rate "
                f"{self.prefix_hit_rate:.1%}, "
                + (f"host hits {self.prefix_host_hit_tokens} tokens, " if self.num_host_blocks else "")
                + f"{self.num_preemptions} preemptions, "
                + (f"{self.num_failed_steps} failed steps, " if self.num_failed_steps else "")
                + f"mean batch "
                f"{self.mean_running_seqs:.1f} (peak {self.peak_running_seqs}))")

    @property
    def sharing_saving(self) -> float:
        """Share of block-table entries served by a block another table also holds (prefix caching,
        parallel sampling): ``1 - mean_used_blocks / mean_table_blocks``; 0 without sharing."""
        return 1.0 - self.mean_used_blocks / self.mean_table_blocks if self.mean_table_blocks else 0.0

    @property
    def input_tokens_per_s(self) -> float:
        """Prompt tokens of the served requests per elapsed second (0 before any generate)."""
        return self.num_prompt_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        """Sampled tokens per elapsed second (0 before any generate)."""
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def prefix_computed_tokens(self) -> int:
        """Prompt tokens looked up that neither tier served, so computed (recomputed ones included)."""
        return self.prefix_query_tokens - self.prefix_hit_tokens - self.prefix_host_hit_tokens

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the prefix cache (0 when nothing was looked up)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class StatsRecorder:
    """Accumulates the per-step figures :class:`LLMStats` reports."""

    __slots__ = ("computed", "elapsed_s", "generated", "kv_util_sum", "peak_used", "prompt", "queued_running_sum",
                 "queued_steps", "queued_util_sum", "rejected", "running_sum", "served", "steps", "table_sum",
                 "used_sum")

    def __init__(self) -> None:
        self.steps = self.computed = self.generated = self.prompt = self.served = self.rejected = 0
        self.peak_used = 0
        self.kv_util_sum = 0.0
        self.running_sum = self.used_sum = self.table_sum = 0
        self.queued_steps = self.queued_running_sum = 0
        self.queued_util_sum = 0.0
        self.elapsed_s = 0.0

    def elapsed(self, seconds: float) -> None:
        self.elapsed_s += seconds

    def requests(self, served: int, rejected: int) -> None:
        self.served += served
        self.rejected += rejected

    def prompt_tokens(self, n: int) -> None:
        self.prompt += n

    def step(self, out, num_sampled: int, scheduler, block_manager) -> None:
        """After a step: ``out`` the SchedulerOutput, ``num_sampled`` tokens sampled in it."""
        self.steps += 1
        self.computed += out.num_batched_tokens
        self.generated += num_sampled
        self.running_sum += len(scheduler.running)
        used = block_manager.num_used_blocks
        bs = block_manager.block_size
        self.peak_used = max(self.peak_used, used)
        # the running sequences' tables are the block manager's: both allocators keep their length
        table = block_manager.num_table_blocks
        self.table_sum += table
        self.used_sum += min(used, table)  # a contiguous reservation holds more than its table: no sharing
        # token states held, a shared block's once: both allocators keep the count as they go
        util = block_manager.num_live_tokens / (block_manager.num_blocks * bs)
        self.kv_util_sum += util
        if scheduler.waiting:
            self.queued_steps += 1
            self.queued_running_sum += len(scheduler.running)
            self.queued_util_sum += util

    def snapshot(self, block_manager, scheduler) -> LLMStats:
        m = block_manager.metrics()
        steps = max(self.steps, 1)
        return LLMStats(
            num_blocks=block_manager.num_blocks, block_size=block_manager.block_size,
            num_used_blocks=block_manager.num_used_blocks, num_free_blocks=block_manager.num_free_blocks,
            num_cached_blocks=block_manager.num_cached_blocks, peak_used_blocks=self.peak_used,
            mean_kv_utilisation=self.kv_util_sum / steps, mean_used_blocks=self.used_sum / steps,
            mean_table_blocks=self.table_sum / steps,
            prefix_query_tokens=getattr(m, "prefix_query_tokens", 0),
            prefix_hit_tokens=getattr(m, "prefix_hit_tokens", 0),
            num_preemptions=scheduler.num_preemptions, num_steps=self.steps, num_requests=self.served,
            num_rejected_requests=self.rejected, num_prompt_tokens=self.prompt,
            num_computed_tokens=self.computed, num_generated_tokens=self.generated,
            peak_running_seqs=scheduler.peak_running, mean_running_seqs=self.running_sum / steps,
            mean_running_seqs_queued=self.queued_running_sum / max(self.queued_steps, 1),
            mean_kv_utilisation_queued=self.queued_util_sum / max(self.queued_steps, 1),
            elapsed_s=self.elapsed_s, num_failed_steps=scheduler.num_rollbacks,
            num_swap_outs=getattr(scheduler, "num_swap_outs", 0), num_swap_ins=getattr(scheduler, "num_swap_ins", 0),
            num_swap_fallbacks=getattr(scheduler, "num_swap_fallbacks", 0),
            num_swapped_out_blocks=getattr(scheduler, "num_swapped_out_blocks", 0),
            num_swapped_in_blocks=getattr(scheduler, "num_swapped_in_blocks", 0),
            prefix_host_hit_tokens=getattr(m, "prefix_host_hit_tokens", 0),
            num_host_blocks=getattr(m, "host_blocks", 0), num_host_cached_blocks=getattr(m, "host_cached_blocks", 0),
            num_offloaded_blocks=getattr(m, "host_stored_blocks", 0),
            num_loaded_blocks=getattr(m, "host_loaded_blocks", 0), num_host_evictions=getattr(m, "host_evictions", 0),
        )
