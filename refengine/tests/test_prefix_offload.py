"""The prefix cache's host tier (``LLM(kv_offloading_size=GiB)``): greedy tokens equal with and without it
on a workload whose shared prefix the device cache alone evicts, host hits counted apart from device hits
and computed tokens, loads applied before the forward that reads them, the block round trip exact, LRU on
the host tier, and bad sizes refused before anything is allocated."""

from __future__ import annotations

import pytest
import torch
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.engine import host_memory_arguments
from pagedbench.refengine.engine import llm as llm_module
from pagedbench.refengine.engine.leak_check import check_no_leak
from pagedbench.refengine.engine.schedule_plan import BlockSwap, SchedulerOutput
from pagedbench.refengine.errors import InsufficientMemoryError, InvalidArgumentError
from pagedbench.refengine.kv import prefix_hash
from pagedbench.refengine.kv.block_manager import BlockManager
from pagedbench.refengine.kv.block_pool import BlockPool
from pagedbench.refengine.kv.host_pool import HostBlockPool
from pagedbench.refengine.kv.swap_copy import copy_blocks_between
from pagedbench.refengine.tests.test_engine_faults import MODEL

BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 8 * 4  # K and V x 2 layers x 4 slots x 2 heads x head_dim 8 x fp32
SHARED = [(7 * i + 3) % 256 for i in range(16)]  # four blocks of 4


def gib(num_blocks: int) -> float:
    return num_blocks * BYTES_PER_BLOCK / 2**30


def offload_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts with the shared prefix, each followed by one long enough to evict it from a 16-block pool."""
    prompts = []
    for i in range(3):
        prompts.append([*SHARED, 100 + i, 50 + i])
        prompts.append([(11 * j + 5 * i + 1) % 256 for j in range(60)])
    params = [SamplingParams(max_tokens=5, ignore_eos=True) for _ in prompts]
    return prompts, params


def make_llm(loaded, **kw) -> LLM:
    # one request at a time: each long prompt takes nearly the whole pool, evicting the shared prefix
    kw = {"block_size": 4, "num_blocks": 16, "max_num_batched_tokens": 24, "max_num_seqs": 1, **kw}
    llm = LLM(loaded, check_invariants=True, seed=3, **kw)
    llm.executor.check_block_tables = True
    return llm


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, attention_backend="torch-batched", seed=1)


def tokens_of(llm: LLM, prompts, params) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


def record_order(llm: LLM, monkeypatch) -> list:
    """("copies", out) when the executor applies a step's pool copies, ("forward", None) at each forward."""
    seen = []
    real_swaps, real_forward = llm.executor.apply_swaps, llm.model.forward
    monkeypatch.setattr(llm.executor, "apply_swaps", lambda out: (seen.append(("copies", out)), real_swaps(out))[1])
    monkeypatch.setattr(llm.model, "forward", lambda *a: (seen.append(("forward", None)), real_forward(*a))[1])
    return seen


def test_greedy_tokens_are_those_without_the_tier_and_the_host_serves_the_evicted_prefix(loaded, monkeypatch):
    prompts, params = offload_workload()
    unevicted = tokens_of(make_llm(loaded, num_blocks=128), prompts, params)
    plain = make_llm(loaded)
    without = tokens_of(plain, prompts, params)
    llm = make_llm(loaded, kv_offloading_size=gib(32))
    assert llm.offload_pool.num_blocks == 32 and llm.block_manager.host_tier.num_blocks == 32
    seen = record_order(llm, monkeypatch)
    got = tokens_of(llm, prompts, params)
    assert got == without == unevicted
    st, base = llm.stats, plain.stats
    assert base.prefix_hit_tokens == 0, "the workload was meant to evict the shared prefix from the device"
    assert st.prefix_host_hit_tokens == 2 * len(SHARED), "the second and third shared prompts load the prefix"
    assert st.prefix_hit_tokens == 0
    assert st.prefix_query_tokens == base.prefix_query_tokens
    assert st.prefix_computed_tokens == base.prefix_computed_tokens - st.prefix_host_hit_tokens
    assert st.prefix_computed_tokens == st.prefix_query_tokens - st.prefix_hit_tokens - st.prefix_host_hit_tokens
    assert st.num_computed_tokens == base.num_computed_tokens - st.prefix_host_hit_tokens
    outs = [out for kind, out in seen if kind == "copies"]
    assert sum(len(o.offload_load) for o in outs) == st.num_loaded_blocks == 8
    assert sum(len(o.offload_store) for o in outs) == st.num_offloaded_blocks > 0
    for i, (kind, out) in enumerate(seen):  # a step's loads run before its forward reads them
        if kind == "copies" and out.offload_load:
            assert out.chunks and seen[i + 1][0] == "forward"
    for o in outs:  # one batch per step, no host block or device block written twice
        assert len({s.dst for s in o.offload_store}) == len(o.offload_store)
        assert len({s.dst for s in o.offload_load}) == len(o.offload_load)
    check_no_leak(llm.block_manager, llm.scheduler)


def test_a_block_stored_and_loaded_into_in_one_step_keeps_both_kv(loaded, monkeypatch):
    """The shared prompt's host hits are loaded into blocks whose own KV (the long prompt's) is stored in
    the same step: the stores must read them first, or the long prompt's next hit serves the wrong KV."""
    prompts, params = offload_workload()
    prompts = [*prompts[:3], [*prompts[1][:56], 9, 9]]
    params = params[:4]
    llm = make_llm(loaded, kv_offloading_size=gib(32))
    seen = record_order(llm, monkeypatch)
    got = tokens_of(llm, prompts, params)
    assert got == tokens_of(make_llm(loaded), prompts, params)
    st = llm.stats  # the repeat finds its head on the device, its tail (evicted first) on the host
    assert st.prefix_host_hit_tokens == 16 + 16 and st.prefix_hit_tokens == 56 - 16
    outs = [out for kind, out in seen if kind == "copies"]
    assert any({s.src for s in o.offload_store} & {s.dst for s in o.offload_load} for o in outs), \
        "no step loaded into a block it stored"


def test_the_executor_stores_before_it_loads(loaded):
    """A step that stores device block 3 and loads host block 1 into it: the host must get block 3's KV
    from before the load, and block 3 the host's."""
    llm = make_llm(loaded, kv_offloading_size=gib(4))
    torch.manual_seed(1)
    for pool in (llm.pool, llm.offload_pool):
        for k, v in pool.kv_caches():
            k.copy_(torch.randn_like(k))
            v.copy_(torch.randn_like(v))
    device_before, host_before = slots(llm.pool, [3]), slots(llm.offload_pool, [1])
    out = SchedulerOutput((), (), (), 0, offload_store=(BlockSwap(3, 0),), offload_load=(BlockSwap(1, 3),))
    llm.executor.apply_copies(out)
    for want, got in zip(device_before, slots(llm.offload_pool, [0])):
        assert torch.equal(want, got), "the store read the block after the load wrote it"
    for want, got in zip(host_before, slots(llm.pool, [3])):
        assert torch.equal(want, got), "the load did not write the block"


def test_the_tier_and_swap_preemption_together_keep_the_tokens(loaded):
    """Both host pools in one engine, a pool tight enough to preempt (the fault tests' workload)."""
    from pagedbench.refengine.tests.test_engine_faults import workload

    prompts, params = workload()

    def run(**kw):
        llm = LLM(loaded, block_size=4, max_num_batched_tokens=12, max_num_seqs=8, seed=3, check_invariants=True,
                  **kw)
        return [[c.token_ids for c in r.outputs] for r in llm.generate(prompts, params)], llm

    want, _ = run(num_blocks=128)
    got, llm = run(num_blocks=16, preemption_mode="swap", swap_space=gib(64), kv_offloading_size=gib(16))
    assert llm.stats.num_swap_outs > 0 and llm.stats.num_offloaded_blocks > 0
    assert got == want


# --- the block manager and the pools on their own ---------------------------------------------------------
def random_pools(num_blocks: int, host_blocks: int):
    torch.manual_seed(0)
    pool = BlockPool(2, 2, 8, 4, torch.float64, num_blocks=num_blocks)
    for k, v in pool.kv_caches():
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    return pool, HostBlockPool(pool, host_blocks)


def apply(bm: BlockManager, pool, host) -> tuple[list, list]:
    """The executor's part: the manager's copies, stores then loads, and the commit."""
    stores, loads = bm.take_offload_copies()
    copy_blocks_between(pool.kv_caches(), host.kv_caches(), stores)
    copy_blocks_between(host.kv_caches(), pool.kv_caches(), loads)
    bm.commit_offload_step()
    return stores, loads


def slots(pool, ids: list[int]) -> list[torch.Tensor]:
    return [t[ids].clone() for kv in pool.kv_caches() for t in kv]


def test_a_block_loaded_from_the_host_equals_the_original_in_every_slot():
    pool, host = random_pools(8, 8)
    bm = BlockManager(8, 4, enable_prefix_caching=True, num_host_blocks=8)
    prompt = list(range(1, 15))  # three full blocks and a partial one
    bm.allocate("a", prompt)
    bm.fork("a", "b")  # the shared blocks are one copy each, whoever holds them
    original = bm.block_table("a")[:3]
    want = slots(pool, original)
    bm.free("a")
    bm.free("b")
    bm.allocate("c", [200 + i for i in range(32)])  # the whole pool: every cached block evicted
    stores, loads = apply(bm, pool, host)
    assert sorted(d for d, _ in stores) == sorted(original) and loads == [], "each evicted block stored once"
    for k, v in pool.kv_caches():  # the device copies are overwritten
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    bm.free("c")
    assert bm.allocate("a2", prompt) == 12  # three blocks served by the host tier
    stores, loads = apply(bm, pool, host)
    table = bm.block_table("a2")[:3]
    assert [d for _, d in loads] == table
    for w, g in zip(want, slots(pool, table)):
        assert torch.equal(w.view(torch.int64), g.view(torch.int64)), "a slot changed in the round trip"
    m = bm.metrics()
    assert (m.prefix_host_hit_tokens, m.prefix_hit_tokens, m.host_loaded_blocks) == (12, 0, 3)
    bm.check_invariants()


def block_key(bm: BlockManager, tokens: tuple) -> bytes:
    return prefix_hash.block_hash(prefix_hash.root_hash(None), tokens)


def test_the_host_tier_evicts_its_least_recently_used_entry_and_keeps_what_a_step_reads():
    """Device pool of 2 blocks of 2: each prompt [i, i, 99] publishes (i, i) and evicts the previous one's."""
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_host_blocks=2)
    tier = bm.host_tier

    def serve(i: int) -> tuple[int, list, list]:
        hit = bm.allocate(i, [i, i, 99])
        stores, loads = bm.take_offload_copies()
        bm.commit_offload_step()
        bm.free(i)
        bm.check_invariants()
        return hit, stores, loads

    key = {i: block_key(bm, (i, i)) for i in range(1, 6)}
    serve(1)
    serve(2)
    serve(3)
    assert tier.hashes() == [key[1], key[2]]
    serve(4)  # (3, 3) stored: the tier is full, (1, 1) its least recently used entry goes
    assert tier.hashes() == [key[2], key[3]] and tier.num_evictions == 1
    hit, stores, loads = serve(2)  # a host hit: (2, 2) is pinned while (4, 4) is stored, so (3, 3) goes
    assert hit == 2 and len(loads) == 1 and len(stores) == 1
    assert tier.hashes() == [key[2], key[4]]
    hit, stores, _ = serve(5)  # (2, 2) evicted again: already on the host, no copy, most recently used
    assert hit == 0 and stores == [] and tier.hashes() == [key[4], key[2]]
    assert bm.metrics().host_stored_blocks == 4 and bm.metrics().host_loaded_blocks == 1


def test_an_entry_a_step_loads_is_never_evicted_by_that_step_s_stores():
    """A host hit whose admission evicts two device blocks into a full tier of two: the first store evicts
    the other entry, the second finds every entry pinned and is dropped (the hit's host block is read by
    the step's load: it must not be written by its store)."""
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_host_blocks=2)
    for tokens in ([1, 1, 99], [2, 2, 99], [5, 5, 6, 6]):
        bm.allocate(0, tokens)
        bm.take_offload_copies()
        bm.commit_offload_step()
        bm.free(0)
    h = block_key(bm, (1, 1))
    assert bm.host_tier.hashes() == [h, block_key(bm, (2, 2))]
    assert bm.allocate(1, [1, 1, 99]) == 2  # a host hit, evicting (6, 6) and (5, 5) from the device
    stores, loads = bm.take_offload_copies()
    assert len(stores) == 1 and len(loads) == 1 and bm.metrics().host_dropped_stores == 1
    assert not {x for _, x in stores} & {x for x, _ in loads}, "a store writes the host block the load reads"
    assert h in bm.host_tier.hashes()
    bm.check_invariants()


def test_a_failed_step_drops_what_it_stored_and_unpublishes_what_it_loaded():
    bm = BlockManager(2, 2, enable_prefix_caching=True, num_host_blocks=4)
    for i in (1, 2):
        bm.allocate(i, [i, i, 99])
        bm.take_offload_copies()
        bm.commit_offload_step()
        bm.free(i)
    assert len(bm.host_tier) == 1  # (1, 1)
    assert bm.allocate(3, [1, 1, 99]) == 2  # stores (2, 2), loads (1, 1)
    loaded = bm.block_table(3)[0]
    bm.take_offload_copies()
    assert bm.undo_offload_step() == [loaded]
    assert bm.host_tier.hashes() == [block_key(bm, (1, 1))], "the entry stored in the failed step stays"
    bm.free(3)
    bm.check_invariants()
    assert bm.num_cached_blocks == 0, "a block whose load may not have run is cached"
    assert bm.allocate(4, [1, 1, 99]) == 2  # the host entry is still good
    bm.undo_offload_step()
    bm.free(4)
    assert bm.host_tier.check() is None and not bm.host_tier.in_step


def test_the_leak_check_covers_both_host_pools(loaded):
    llm = make_llm(loaded, preemption_mode="swap", swap_space=gib(8), kv_offloading_size=gib(8))
    check_no_leak(llm.block_manager, llm.scheduler)
    llm.scheduler.host_allocator.take(1)
    with pytest.raises(RuntimeError, match="swap host block leak: 1 of 8 host blocks still held"):
        llm._check_no_leak()
    llm = make_llm(loaded, kv_offloading_size=gib(8))
    llm.block_manager.allocate(0, list(range(1, 10)))  # two full blocks published
    llm.block_manager.free(0)
    llm.block_manager.allocate(1, list(range(100, 164)))  # the whole pool: both stored, not committed
    llm.block_manager.free(1)
    with pytest.raises(RuntimeError, match="host tier leak: a step's copies are still pinned"):
        llm._check_no_leak()


AVAILABLE = 3 * 2**30


@pytest.mark.parametrize("kw, error, message", [
    (dict(kv_offloading_size=-1), InvalidArgumentError, "kv_offloading_size must be a finite number of GiB >= 0, "
                                                        "got -1"),
    (dict(kv_offloading_size=float("nan")), InvalidArgumentError, "kv_offloading_size must be a finite number"),
    (dict(kv_offloading_size=float("inf")), InvalidArgumentError, "kv_offloading_size must be a finite number"),
    (dict(kv_offloading_size="1"), InvalidArgumentError, "kv_offloading_size must be a number of GiB >= 0, got "
                                                         "str '1'"),
    (dict(kv_offloading_size=None), InvalidArgumentError, "kv_offloading_size must be a number of GiB >= 0, got "
                                                          "NoneType"),
    (dict(kv_offloading_size=4), InsufficientMemoryError,
     "kv_offloading_size=4 GiB needs 4,294,967,296 bytes of host memory but only 3,221,225,472 bytes are available"),
    (dict(kv_offloading_size=2, preemption_mode="swap", swap_space=2), InsufficientMemoryError,
     r"kv_offloading_size=2 GiB needs 2,147,483,648 bytes of host memory \(beside swap_space's 2,147,483,648\) "
     "but only 3,221,225,472 bytes are available"),
    (dict(swap_space=4, preemption_mode="swap"), InsufficientMemoryError,
     "swap_space=4 GiB needs 4,294,967,296 bytes of host memory but only 3,221,225,472 bytes are available"),
    (dict(kv_offloading_size=1, allocator="contiguous"), InvalidArgumentError,
     "kv_offloading_size=1 is a host tier of the prefix cache: it needs the paged allocator"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False), InvalidArgumentError,
     "needs the paged allocator with enable_prefix_caching=True, got allocator='paged', enable_prefix_caching=False"),
    (dict(kv_offloading_size=1, tensor_parallel_size=2), InvalidArgumentError,
     r"kv_offloading_size is not supported with tensor_parallel_size > 1 yet"),
], ids=["negative", "nan", "inf", "str", "none", "too-large", "with-swap", "swap-too-large", "contiguous",
        "no-prefix-caching", "tp"])
def test_bad_offloading_sizes_are_refused_before_anything_is_allocated(kw, error, message, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded or a pool allocated before the arguments were checked")
    monkeypatch.setattr(llm_module, "load_model", no_load)
    monkeypatch.setattr(llm_module, "BlockPool", no_load)
    monkeypatch.setattr(llm_module, "HostBlockPool", no_load)
    monkeypatch.setattr(host_memory_arguments, "available_host_memory_bytes", lambda: AVAILABLE)
    if kw.get("tensor_parallel_size", 1) > 1:  # (the size is checked against the machine first)
        monkeypatch.setattr(llm_module, "_tensor_parallel_size", lambda *a: 2)
    with pytest.raises(error, match=message):
        LLM(MODEL, **kw)  # (swap_space's default 4 GiB is not held against the 3 GiB: no swap pool)


def test_a_block_manager_refuses_a_host_tier_it_cannot_use():
    with pytest.raises(InvalidArgumentError, match="num_host_blocks must be an int >= 0, got -1"):
        BlockManager(4, 2, enable_prefix_caching=True, num_host_blocks=-1)
    with pytest.raises(InvalidArgumentError, match="num_host_blocks=2 is a host tier of the prefix cache: it "
                                                   "needs enable_prefix_caching=True"):
        BlockManager(4, 2, num_host_blocks=2)


def test_the_server_exports_each_tier_apart(loaded):
    """/metrics: device hits, host hits and computed prompt tokens, each its own counter, as LLM.stats."""
    from pagedbench.refengine.engine.async_llm import AsyncLLM
    from pagedbench.refengine.server.metrics import ServerMetrics
    from prometheus_client.parser import text_string_to_metric_families

    prompts, params = offload_workload()
    llm = make_llm(loaded, kv_offloading_size=gib(32))
    llm.generate(prompts, params)
    st = llm.stats
    snapshot = AsyncLLM._take_snapshot(type("Front", (), {"llm": llm, "_step_time_s": 0.0})())
    text = ServerMetrics("tiny").render(snapshot).decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["pagedbench:prefix_cache_hits_total"] == st.prefix_hit_tokens == 0
    assert got["pagedbench:prefix_cache_host_hits_total"] == st.prefix_host_hit_tokens == 32
    assert got["pagedbench:prefix_cache_computed_total"] == st.prefix_computed_tokens
    assert got["pagedbench:prefix_cache_queries_total"] == st.prefix_query_tokens == 32 + st.prefix_computed_tokens


def test_a_failed_step_preempts_a_sequence_that_holds_a_loaded_block_without_a_chunk():
    """A request's two waiting sequences are admitted together; the first loads the prefix from the host,
    the second hits those blocks on the device but gets no chunk (the budget is spent). The step fails: the
    second, outside the plan, must be preempted too (its blocks' KV was perhaps never copied)."""
    from pagedbench.refengine.engine.scheduler import Scheduler, StopRule
    from pagedbench.refengine.engine.sequence import Sequence

    bm = BlockManager(8, 4, enable_prefix_caching=True, num_host_blocks=8)
    prompt = list(range(1, 14))  # three full blocks and the last token
    bm.allocate("p", prompt)
    bm.free("p")
    bm.allocate("filler", list(range(100, 132)))  # the whole pool: the prompt's blocks go to the host
    bm.take_offload_copies()
    bm.commit_offload_step()
    bm.free("filler")
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1, stop=StopRule(frozenset(), 64),
                      prefix_caching=True)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    seqs = [Sequence(i, 0, i, list(prompt), len(prompt), params, None) for i in range(2)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert len(out.offload_load) == 3 and [c.seq.seq_id for c in out.chunks] == [0]
    assert sched.running == seqs and bm.block_table(0)[:3] == bm.block_table(1)[:3]
    sched.roll_back()
    assert sched.running == [] and sorted(s.seq_id for s in sched.waiting) == [0, 1]
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
    out = sched.schedule()  # the retry loads the prefix again: nothing of the failed load is hit
    assert len(out.offload_load) == 3
