"""Swap preemption and the prefix cache's host tier in one engine, under faults: a workload that both
swaps a group out and back and loads an evicted prefix from the host tier; a fault at every step and
seam (the engine's, and just before each of the four copies between the device and the two host pools)
changes no token, and leaves nothing held on the device, in the swap pool or in the host tier."""

from __future__ import annotations

import pytest
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.engine.leak_check import check_no_leak
from pagedbench.refengine.tests.test_engine_faults import MODEL, Fault, fail_at_every_step, plant, serve
from pagedbench.refengine.tests.test_prefix_offload import SHARED, gib
from pagedbench.refengine.tests.test_prefix_offload_faults import plant_copy

#: the copies between the pools: (the side of the copy the host pool is on, which host pool)
COPY_SEAMS = {"swap-out": ("dst", "host_pool"), "swap-in": ("src", "host_pool"),
              "offload-store": ("dst", "offload_pool"), "offload-load": ("src", "offload_pool")}
SEAMS = ("planning", "forward", "mid-forward", "copy", "update", "mid-update", *COPY_SEAMS)


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """The shared prefix; two requests (one of two samples, its last prompt block partial: the fork copies
    it on write) that outgrow the pool together, so one is swapped out, and evict the prefix's cached
    blocks; the shared prefix again (a host hit)."""
    prompts = [[*SHARED, 100, 50], [(11 * j + 1) % 256 for j in range(20)], [(13 * j + 2) % 256 for j in range(19)],
               [*SHARED, 101, 51]]
    params = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=3, ignore_eos=True)]
    return prompts, params


def make_llm(loaded, **kw) -> LLM:
    kw = {"block_size": 4, "num_blocks": 16, "max_num_batched_tokens": 16, "max_num_seqs": 3,
          "preemption_mode": "swap", "swap_space": gib(64), "kv_offloading_size": gib(32), **kw}
    llm = LLM(loaded, check_invariants=True, seed=3, **kw)
    llm.executor.check_block_tables = True
    return llm


def plant_both(llm: LLM, seam: str, fault: Fault, monkeypatch) -> None:
    """The engine's seams, or the fault just before the copy of ``seam`` (so that copy never ran)."""
    if seam not in COPY_SEAMS:
        plant(llm, seam, fault, monkeypatch)
        return
    side, pool = COPY_SEAMS[seam]
    plant_copy(getattr(llm, pool), side, fault, monkeypatch)


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, attention_backend="torch-batched", seed=1)


@pytest.fixture(scope="module")
def fault_free(loaded):
    prompts, params = workload()
    roomy = make_llm(loaded, num_blocks=128, preemption_mode="recompute", kv_offloading_size=0)
    want, _ = serve(roomy, prompts, params)
    assert roomy.stats.num_preemptions == 0
    llm = make_llm(loaded)
    got, steps = serve(llm, prompts, params)
    st = llm.stats  # both tiers really used, or the faults below would test neither
    assert st.num_swap_outs > 0 and st.num_swap_ins == st.num_swap_outs and st.num_swap_fallbacks == 0
    assert st.prefix_host_hit_tokens > 0 and st.num_offloaded_blocks > 0
    assert got == want
    check_no_leak(llm.block_manager, llm.scheduler)
    return want, steps


@pytest.mark.parametrize("seam", SEAMS)
def test_a_failed_step_with_swaps_and_host_tier_copies_changes_no_token_and_leaks_nothing(
        loaded, fault_free, seam, monkeypatch):
    want, num_steps = fault_free
    prompts, params = workload()
    fired = fail_at_every_step(lambda: make_llm(loaded), lambda llm, fault: plant_both(llm, seam, fault, monkeypatch),
                               prompts, params, want, num_steps, seam,
                               after=lambda llm: check_no_leak(llm.block_manager, llm.scheduler))
    assert fired >= 1, f"the {seam} fault never fired"
