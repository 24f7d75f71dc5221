"""Swap preemption in the serving simulator: the real scheduler swapping to a host pool serves the same
completions as recompute, and each step that copies blocks is priced over the host link."""

from __future__ import annotations

import pytest
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, constant_step, simulate
from pagedbench.bench.workloads import synthetic

PAGED = AllocatorSpec("paged", 16)
BLOCK_S = 1e-3


def _run(mode: str, *, price: bool = True, account: bool = False):
    trace = synthetic("sharegpt", 60, rate=50.0, seed=1, max_seq_len=1024)
    step = constant_step(0.02)
    if price:
        step.block_copy_s = lambda num_out, num_in: BLOCK_S * (num_out + num_in)
    cfg = SimConfig(kv_slots=3000, max_seq_len=1024, preemption_mode=mode, swap_blocks=1000)
    return simulate(trace, PAGED, cfg, step_time_s=step, account=account, record_steps=account)


def test_swap_serves_the_same_completions_as_recompute_with_more_copy_time():
    recompute, swap = _run("recompute"), _run("swap")
    assert recompute.num_preemptions > 0 and swap.num_preemptions > 0  # the pool is tight enough to preempt
    for r in (recompute, swap):
        assert r.num_finished == 60 and all(t.finished for t in r.requests)
    assert [(t.request_id, len(t.token_times_s)) for t in recompute.requests] == \
        [(t.request_id, len(t.token_times_s)) for t in swap.requests]
    assert recompute.num_generated_tokens == swap.num_generated_tokens == sum(t.output_len for t in swap.requests)
    assert recompute.copies == () and recompute.copy_s == 0.0
    assert swap.num_swapped_out_blocks > 0 and swap.num_swapped_in_blocks == swap.num_swapped_out_blocks
    assert sum(c.num_swapped_out for c in swap.copies) == swap.num_swapped_out_blocks
    assert swap.copy_s == pytest.approx(BLOCK_S * 2 * swap.num_swapped_out_blocks)
    assert swap.copy_s == pytest.approx(sum(c.copy_s for c in swap.copies))


def test_a_copy_lengthens_the_step_that_makes_it():
    priced, free = _run("swap"), _run("swap", price=False)
    assert free.copy_s == 0.0 and free.copies and all(c.copy_s == 0.0 for c in free.copies)
    # the same schedule, each copying step longer by its price (until the first shifted arrival)
    first = priced.copies[0]
    assert first.copy_s == pytest.approx(BLOCK_S * (first.num_swapped_out + first.num_swapped_in))
    assert priced.simulated_s > free.simulated_s


def test_swap_with_the_memory_accounted_keeps_the_slot_identity():
    r = _run("swap", account=True)
    assert r.num_swapped_out_blocks > 0 and r.steps
    assert all(s.token_states + s.reserved + s.internal_fragmentation + s.external_fragmentation + s.free
               == r.total_slots for s in r.steps)


def test_swap_needs_the_paged_manager_and_a_known_mode():
    trace = synthetic("alpaca", 4, rate=1.0)
    with pytest.raises(ValueError, match="swap preemption needs the paged manager"):
        simulate(trace, AllocatorSpec("orca", 1, "oracle"), SimConfig(preemption_mode="swap", swap_blocks=10))
    with pytest.raises(ValueError, match="preemption_mode must be 'recompute' or 'swap', got 'drop'"):
        SimConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_blocks must be an int >= 0"):
        SimConfig(swap_blocks=-1)
