"""Swap preemption: the same tokens as recompute and as an unpreempted run, the block copies between the
pools exact (a shared block copied once, sharing kept), nothing leaked on the device or the host after a
run, a failed step or an abort, the fallback to recompute counted, and bad arguments refused up front."""

from __future__ import annotations

import pytest
import torch
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.engine import host_memory_arguments, model_executor
from pagedbench.refengine.engine import llm as llm_module
from pagedbench.refengine.errors import InsufficientMemoryError, InvalidArgumentError
from pagedbench.refengine.kv.block_manager import BlockManager
from pagedbench.refengine.kv.block_pool import BlockPool
from pagedbench.refengine.kv.host_pool import HostBlockPool
from pagedbench.refengine.kv.swap_copy import copy_blocks_between
from pagedbench.refengine.tests.test_engine_faults import (
    MODEL,
    Fault,
    fail_at_every_step,
    make_llm,
    plant,
    serve,
    workload,
)

BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 8 * 4  # K and V x 2 layers x 4 slots x 2 heads x head_dim 8 x fp32


def gib(num_blocks: int) -> float:
    return num_blocks * BYTES_PER_BLOCK / 2**30


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, attention_backend="torch-batched", seed=1)


@pytest.fixture(scope="module")
def unpreempted(loaded):
    prompts, params = workload()
    llm = make_llm(loaded, num_blocks=128)
    got, _ = serve(llm, prompts, params)
    assert llm.stats.num_preemptions == 0
    return got


def swap_llm(loaded, host_blocks: int = 64, **kw) -> LLM:
    llm = make_llm(loaded, preemption_mode="swap", swap_space=gib(host_blocks), **kw)
    assert llm.host_pool.num_blocks == host_blocks
    return llm


def assert_host_free(llm: LLM) -> None:
    host = llm.scheduler.host_allocator
    assert host.num_free_blocks == host.num_blocks, "host blocks leaked"
    assert not llm.scheduler.swapped


def record_swaps(llm: LLM, monkeypatch) -> list:
    """Each step's (swap_out, swap_in) as the executor applies them."""
    seen = []
    real = llm.executor.apply_swaps
    monkeypatch.setattr(llm.executor, "apply_swaps", lambda out: (seen.append((out.swap_out, out.swap_in)),
                                                                   real(out))[1])
    return seen


@pytest.mark.parametrize("kw", [{}, dict(policy="separate"), dict(enable_prefix_caching=False)], ids=str)
def test_swap_gives_the_tokens_of_recompute_and_of_an_unpreempted_run(loaded, unpreempted, kw, monkeypatch):
    prompts, params = workload()  # greedy, seeded n=3 and n=2 (shared blocks, copy-on-write)
    recompute, _ = serve(make_llm(loaded, **kw), prompts, params)
    llm = swap_llm(loaded, **kw)
    seen = record_swaps(llm, monkeypatch)
    got, _ = serve(llm, prompts, params)
    st = llm.stats
    assert st.num_swap_outs > 0 and st.num_swap_ins == st.num_swap_outs and st.num_swap_fallbacks == 0
    assert got == recompute == unpreempted
    outs = [s.src for o, _ in seen for s in o]
    ins = [s.src for _, i in seen for s in i]
    assert len(outs) == st.num_swapped_out_blocks == st.num_swapped_in_blocks == len(ins)
    for o, i in seen:  # within a step no device block is copied out twice, no host block read twice
        assert len({s.src for s in o}) == len(o) and len({s.src for s in i}) == len(i)
    assert_host_free(llm)


def test_a_shared_block_is_swapped_once_and_stays_shared(loaded, monkeypatch):
    """Two samples of one request share their prompt's blocks when they are swapped out."""
    prompts, params = workload()
    llm = swap_llm(loaded)
    seen = record_swaps(llm, monkeypatch)
    shared_after_swap_in = []
    real_step = llm.core.step

    def step():
        report = real_step()
        if report.output.swap_in:
            bm = llm.block_manager
            ids = [b.dst for b in report.output.swap_in]
            shared_after_swap_in.append(max(bm.ref_count(b) for b in ids))
        return report
    monkeypatch.setattr(llm.core, "step", step)
    serve(llm, prompts, params)
    assert seen and shared_after_swap_in, "no swap happened"
    assert max(shared_after_swap_in) > 1, "no swapped-in block is shared by several tables"


def random_pools(num_blocks: int = 12):
    torch.manual_seed(0)
    pool = BlockPool(2, 2, 8, 4, torch.float64, num_blocks=num_blocks)
    for k, v in pool.kv_caches():
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    return pool, HostBlockPool(pool, 8)


def contents(pool, table: list[int]) -> list[torch.Tensor]:
    return [t[table].clone() for kv in pool.kv_caches() for t in kv]


def test_the_block_round_trip_is_exact_and_copies_a_shared_block_once():
    pool, host = random_pools()
    bm = BlockManager(pool.num_blocks, 4)
    bm.allocate("a", list(range(10)))  # 3 blocks, the last partial
    bm.fork("a", "b")  # "b" shares all three
    bm.append_token("b", 7)  # copy-on-write: "b" gets a fresh last block (its copy applied below)
    (src, dst), = [(t[-1], bm.block_table("b")[-1]) for t in [bm.block_table("a")]]
    pool.copy_blocks([(src, dst)])
    before = {s: contents(pool, bm.block_table(s)) for s in ("a", "b")}
    tables = bm.swap_out(["a", "b"])
    assert len(tables.block_ids) == 4, "a block shared by both tables must be copied once"
    host_ids = list(range(len(tables.block_ids)))
    copy_blocks_between(pool.kv_caches(), host.kv_caches(), list(zip(tables.block_ids, host_ids)))
    bm.check_invariants()
    assert bm.num_free_blocks == pool.num_blocks
    for k, v in pool.kv_caches():  # another table writes the freed blocks
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    bm.allocate("c", list(range(9)))  # takes fresh blocks, so the swap-in lands elsewhere
    placed = bm.swap_in(tables)
    copy_blocks_between(host.kv_caches(), pool.kv_caches(), [(host_ids[i], d) for i, d in placed])
    bm.check_invariants()
    for s in ("a", "b"):
        for want, got in zip(before[s], contents(pool, bm.block_table(s))):
            assert torch.equal(want.double(), got.double()), f"sequence {s}: a slot changed in the round trip"
    shared = bm.block_table("a")[:2]
    assert shared == bm.block_table("b")[:2] and [bm.ref_count(b) for b in shared] == [2, 2]
    assert bm.ref_count(bm.block_table("a")[2]) == 1


def test_copy_blocks_between_refuses_bad_pairs_and_writes_nothing():
    pool, host = random_pools()
    before = [t.clone() for kv in host.kv_caches() for t in kv]
    with pytest.raises(InvalidArgumentError, match="destination blocks must be distinct"):
        copy_blocks_between(pool.kv_caches(), host.kv_caches(), [(0, 1), (2, 1)])
    with pytest.raises(InvalidArgumentError, match=r"destination block ids must be ints in \[0, 8\)"):
        copy_blocks_between(pool.kv_caches(), host.kv_caches(), [(0, 8)])
    assert all(torch.equal(a.view(torch.int64), b.view(torch.int64))
               for a, b in zip(before, [t for kv in host.kv_caches() for t in kv]))


def test_a_host_pool_too_small_falls_back_to_recompute(loaded, unpreempted):
    prompts, params = workload()
    for host_blocks in (0, 1):
        llm = swap_llm(loaded, host_blocks=host_blocks)
        got, _ = serve(llm, prompts, params)
        st = llm.stats
        assert st.num_swap_fallbacks > 0 and st.num_swap_outs == 0
        assert got == unpreempted
        assert_host_free(llm)


SEAMS = ("planning", "forward", "mid-forward", "copy", "update", "swap-out", "swap-in")


def plant_swap(llm: LLM, seam: str, fault: Fault, monkeypatch) -> None:
    """The engine's seams, and the two copies between the pools (the fault before that copy)."""
    if seam not in ("swap-out", "swap-in"):
        plant(llm, seam, fault, monkeypatch)
        return
    real = model_executor.copy_blocks_between
    host_k = llm.host_pool.kv_caches()[0][0]

    def copy(src, dst, pairs):  # the fault before the copy: it never ran
        if pairs and (dst[0][0] is host_k) == (seam == "swap-out"):
            fault.hit()
        real(src, dst, pairs)
    monkeypatch.setattr(model_executor, "copy_blocks_between", copy)


@pytest.mark.parametrize("seam", SEAMS)
def test_a_failed_step_with_swaps_leaks_nothing_and_changes_no_token(loaded, unpreempted, seam, monkeypatch):
    prompts, params = workload()
    _, num_steps = serve(swap_llm(loaded), prompts, params)
    fired = fail_at_every_step(lambda: swap_llm(loaded), lambda llm, fault: plant_swap(llm, seam, fault, monkeypatch),
                               prompts, params, unpreempted, num_steps, seam, after=assert_host_free)
    assert fired >= 1, f"the {seam} fault never fired"


def test_an_abort_of_a_swapped_request_frees_its_host_blocks(loaded):
    prompts, params = workload()
    llm = swap_llm(loaded)
    for p, sp in zip(prompts, params):
        llm.core.add(llm.core.new_request(p, sp))
    while not llm.scheduler.swapped:
        llm.step()
    assert llm.scheduler.host_allocator.num_free_blocks < 64
    llm.abort_all()
    assert llm.stats.num_used_blocks == 0
    assert_host_free(llm)


@pytest.mark.parametrize("kw, error, message", [
    (dict(preemption_mode="swapping"), InvalidArgumentError, "preemption_mode must be one of recompute, swap; "
                                                             "got 'swapping'"),
    (dict(preemption_mode=None), InvalidArgumentError, "preemption_mode must be one of"),
    (dict(swap_space=-1), InvalidArgumentError, "swap_space must be a finite number of GiB >= 0, got -1"),
    (dict(swap_space=float("nan")), InvalidArgumentError, "swap_space must be a finite number of GiB >= 0"),
    (dict(swap_space="4"), InvalidArgumentError, "swap_space must be a number of GiB >= 0, got str '4'"),
    (dict(swap_space=True), InvalidArgumentError, "swap_space must be a number of GiB >= 0, got bool"),
    (dict(swap_space=2.0**40, preemption_mode="swap"), InsufficientMemoryError,
     r"swap_space=1099511627776.0 GiB needs 1,180,591,620,717,411,303,424 bytes of host memory but only [\d,]+ "
     "bytes are available"),
    (dict(preemption_mode="swap", allocator="contiguous"), InvalidArgumentError,
     "preemption_mode='swap' needs the paged allocator"),
], ids=["mode", "mode-none", "negative", "nan", "str", "bool", "too-large", "contiguous"])
def test_bad_swap_arguments_are_refused_before_anything_is_allocated(kw, error, message, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(llm_module, "load_model", no_load)
    monkeypatch.setattr(llm_module, "BlockPool", no_load)
    with pytest.raises(error, match=message):
        LLM(MODEL, **kw)


def test_swap_space_is_held_against_the_host_only_in_swap_mode(monkeypatch):
    """Recompute allocates no swap pool, so its size needs no memory (the default 4 GiB on a small host)."""
    class Loaded(Exception):
        pass

    def loaded(*a, **k):
        raise Loaded
    monkeypatch.setattr(llm_module, "load_model", loaded)
    monkeypatch.setattr(host_memory_arguments, "available_host_memory_bytes", lambda: 2**30)
    with pytest.raises(Loaded):  # the checks passed: the model was about to load
        LLM(MODEL, swap_space=2.0**40)
    with pytest.raises(InvalidArgumentError, match="swap_space must be a finite number of GiB >= 0, got -1"):
        LLM(MODEL, swap_space=-1)  # a bad value is still refused
    with pytest.raises(InsufficientMemoryError, match="swap_space=4 GiB needs 4,294,967,296 bytes"):
        LLM(MODEL, preemption_mode="swap")


def test_a_victim_that_copied_on_write_in_the_same_step_swaps_out_the_copied_content(loaded):
    """Four samples share a partial last block; the first copies it on write (a fresh block, its copy
    dropped when the group is preempted in the same step): the swap-out must copy the source's KV."""
    prompts = [[(3 * i + 1) % 256 for i in range(5)], [(5 * i + 2) % 256 for i in range(5)]]
    params = [SamplingParams(n=4, temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in (1, 2)]

    def run(**kw):
        llm = LLM(loaded, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, seed=3, check_invariants=True,
                  poison_kv_cache=True, **kw)
        return [[c.token_ids for c in r.outputs] for r in llm.generate(prompts, params)], llm

    want, _ = run(num_blocks=64)
    got, llm = run(num_blocks=9, preemption_mode="swap", swap_space=gib(64))
    assert llm.stats.num_swap_outs > 0
    assert got == want


class FailingAfterSwapIn:
    """The scheduler's view of a block manager whose first append after a swap-in fails (the group's blocks
    are placed; its later sequences are not yet marked running)."""

    def __init__(self, inner, fault: Fault) -> None:
        self.inner, self.fault = inner, fault

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def swap_in(self, tables):
        placed = self.inner.swap_in(tables)
        self.fault.armed = not self.fault.fired
        return placed

    def append_token(self, *args):
        self.fault.hit()
        return self.inner.append_token(*args)


def test_a_planning_failure_inside_a_swap_in_loses_no_sequence(loaded, monkeypatch):
    """Every sequence of the group being swapped in is recompute-preempted, those the swap-in had not
    reached included: none is dropped with the device blocks it was given."""
    from pagedbench.refengine.tests.test_swap_with_host_tier_faults import make_llm as both_llm
    from pagedbench.refengine.tests.test_swap_with_host_tier_faults import workload as both_workload

    prompts, params = both_workload()  # a two-sample group is swapped out, and in while nothing runs
    want, _ = serve(both_llm(loaded, num_blocks=128, preemption_mode="recompute", kv_offloading_size=0), prompts,
                    params)
    llm = both_llm(loaded, kv_offloading_size=0)
    fault = Fault()
    monkeypatch.setattr(llm.scheduler, "block_manager", FailingAfterSwapIn(llm.block_manager, fault))
    got, _ = serve(llm, prompts, params, seam="planning")  # (checks that no device block is left held)
    assert fault.fired == 1 and llm.stats.num_swap_ins >= 1
    assert got == want
    assert_host_free(llm)
