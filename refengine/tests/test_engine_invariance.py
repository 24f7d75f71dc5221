"""Differential invariance of the engine: greedy tokens bit-identical to the plain run.

The *plain run* serves each prompt alone (block size 16, no prefix caching, a large pool, one chunk).
Every other configuration changes one axis -- batching, block size, prefix caching, chunk size, a pool
small enough to force preemption, the allocator, the attention backend -- and must produce exactly the
same tokens. Sampling: with a fixed seed it is reproducible, and child ``i`` of an ``n > 1`` request
equals the same request run alone with seed ``seed + i`` (siblings share the prompt's blocks, so a
missing copy-on-write would show). Every run checks the block manager's invariants after every step
(``check_invariants=True``) and ends with every block free. The KV pool is NaN-poisoned, so a read of
a slot nobody wrote (a block published before its K/V was computed, a copy-on-write copy not applied)
turns into NaN logits and wrong tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedbench.refengine import LLM, SamplingParams, load_model

MODEL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
#: around block edges of 1/16/32 (1, 15, 16, 17, 33) and awkward lengths (5, 23)
PROMPT_LENS = (1, 5, 15, 16, 17, 23, 33)
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["torch", "torch-batched"])
def loaded(request):
    """The per-sequence reference backend and the batched one (the CPU default): same tokens."""
    return load_model(MODEL, attention_backend=request.param, seed=1)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, MODEL["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]


def make_llm(loaded, **kw) -> LLM:
    kw.setdefault("block_size", 16)
    kw.setdefault("num_blocks", 128)
    kw.setdefault("enable_prefix_caching", False)
    llm = LLM(loaded, check_invariants=True, **kw)
    llm.executor.check_block_tables = True  # every persistent block-table row a step reads, checked
    return llm


def serve(llm: LLM, prompts, params=GREEDY) -> list[list[list[int]]]:
    """Tokens of every completion of every prompt; checks nothing failed and no block leaked."""
    outs = llm.generate(prompts, params)
    assert [o.error for o in outs] == [None] * len(prompts)
    assert llm.stats.num_used_blocks == 0 and llm.stats.num_free_blocks == llm.stats.num_blocks
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def plain(loaded, prompts) -> list[list[list[int]]]:
    llm = make_llm(loaded, max_num_batched_tokens=256)
    out = [serve(llm, [p])[0] for p in prompts]
    assert all(len(c[0]) == MAX_TOKENS for c in out)
    assert len({tuple(c[0]) for c in out}) == len(out), "the plain run's prompts should give distinct outputs"
    return out


# --- greedy invariance, one axis at a time ---------------------------------------------------------------
def test_batch_equals_alone(loaded, prompts, plain):
    assert serve(make_llm(loaded), prompts) == plain


def test_batch_order_does_not_matter(loaded, prompts, plain):
    got = serve(make_llm(loaded), prompts[::-1])
    assert got == plain[::-1]


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_size(loaded, prompts, plain, block_size):
    llm = make_llm(loaded, block_size=block_size, num_blocks=2048 // block_size)
    assert serve(llm, prompts) == plain


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_chunked_prefill(loaded, prompts, plain, chunk, block_size):
    llm = make_llm(loaded, block_size=block_size, num_blocks=1024 // block_size, max_num_batched_tokens=chunk)
    assert serve(llm, prompts) == plain
    assert llm.stats.num_steps > sum(PROMPT_LENS) // chunk  # really chunked


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_caching_twins_in_one_batch(loaded, prompts, plain, block_size):
    """Identical prompts in the same batch, with and without chunking (a twin admitted while the other
    is mid-prefill must not read blocks whose K/V is not written yet: vLLM #7822)."""
    for chunk in (512, 5):
        llm = make_llm(loaded, block_size=block_size, num_blocks=1024 // block_size,
                       enable_prefix_caching=True, max_num_batched_tokens=chunk)
        batch = [prompts[-1], prompts[-1], prompts[3], prompts[-1]]
        assert serve(llm, batch) == [plain[-1], plain[-1], plain[3], plain[-1]]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_caching_fully_cached_prompt(loaded, prompts, plain, block_size):
    """A prompt served again is cached up to its last token, which is still computed for its logits."""
    llm = make_llm(loaded, block_size=block_size, num_blocks=1024 // block_size, enable_prefix_caching=True)
    assert serve(llm, prompts) == plain
    outs = llm.generate(prompts, GREEDY)
    assert [[c.token_ids for c in o.outputs] for o in outs] == plain
    for p, o in zip(prompts, outs):
        assert o.num_cached_tokens == (len(p) - 1) // block_size * block_size
    assert llm.stats.prefix_hit_tokens > 0


def test_prefix_caching_shared_prefix(loaded, prompts, plain):
    """Prompts sharing a system prefix with a cached prompt hit it and still equal their plain runs."""
    system = prompts[-1][:32]
    batch = [system + p for p in prompts[:3]]
    want = [serve(make_llm(loaded), [p])[0] for p in batch]
    llm = make_llm(loaded, block_size=4, num_blocks=256, enable_prefix_caching=True)
    serve(llm, [prompts[-1]])
    outs = llm.generate(batch, GREEDY)
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [32, 32, 32]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("block_size", [1, 4])
def test_forced_preemption(loaded, prompts, plain, block_size, caching):
    longest = max(PROMPT_LENS) + MAX_TOKENS - 1
    num_blocks = -(-longest // block_size) + 2  # one request fits; the batch does not
    llm = make_llm(loaded, block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching)
    assert serve(llm, prompts) == plain
    assert llm.stats.num_preemptions > 0


def test_forced_preemption_with_chunks(loaded, prompts):
    """Chunks of 3 tokens and a pool that holds the prompts but not their growth."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    batch = prompts[1:4]  # 5, 15, 16 tokens: 3 + 8 + 8 blocks of 2 admitted, +12 blocks each to finish
    want = [serve(make_llm(loaded), [p], params)[0] for p in batch]
    llm = make_llm(loaded, block_size=2, num_blocks=24, max_num_batched_tokens=3, enable_prefix_caching=True)
    assert serve(llm, batch, params) == want
    assert llm.stats.num_preemptions > 0


@pytest.mark.parametrize(("grow_tokens", "num_blocks"), [(20, 12), (24, 11)])
def test_prefix_caching_preempted_mid_prefill(loaded, prompts, grow_tokens, num_blocks):
    """A prompt preempted halfway through its chunked prefill leaves only blocks with written K/V in the
    prefix cache: it and its twin, re-admitted later, hit those and must equal their plain runs (vLLM
    #7822: publishing a prompt's blocks at allocation serves unwritten -- here NaN -- K/V)."""
    grow, long = prompts[1], prompts[6]
    p_grow = SamplingParams(max_tokens=grow_tokens, ignore_eos=True)
    want = [serve(make_llm(loaded), [grow], p_grow)[0]] + [serve(make_llm(loaded), [long])[0]] * 2
    llm = make_llm(loaded, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=3,
                   enable_prefix_caching=True)
    assert serve(llm, [grow, long, long], [p_grow, GREEDY, GREEDY]) == want
    assert llm.stats.num_preemptions > 0 and llm.stats.prefix_hit_tokens > 0


def test_contiguous_allocator(loaded, prompts, plain):
    llm = make_llm(loaded, allocator="contiguous", max_model_len=64, num_blocks=16)
    assert serve(llm, prompts) == plain
    # 16 blocks hold 4 reservations of 64 slots: the 7 requests queue for them (never preempted)
    assert llm.stats.peak_running_seqs == 4 and llm.stats.num_preemptions == 0


def test_triton_backend(prompts):
    """The Triton kernels (under the interpreter on the CPU: tiny model, few tokens) give the same tokens."""
    from pagedbench import kernels

    if not all(hasattr(kernels, op) for op in ("paged_decode", "paged_prefill", "write_kv")):
        pytest.skip("not supported: kernels does not export the Triton paged_decode/paged_prefill launchers")
    tiny = dict(MODEL, num_hidden_layers=1)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    batch = [prompts[0], prompts[1][:3], prompts[2][:7]]
    by_backend = []
    for name in ("torch", "triton"):
        llm = LLM(load_model(tiny, attention_backend=name, seed=3), block_size=4, num_blocks=16,
                  check_invariants=True)
        by_backend.append(serve(llm, batch, params))
    assert by_backend[0] == by_backend[1]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_configurations(loaded, prompts, plain, data):
    """Random batches (duplicates included), per-request max_tokens, block sizes, pool sizes from "one
    request just fits" up, chunk sizes, prefix caching on/off, allocator: always the plain tokens."""
    idx = data.draw(st.lists(st.integers(0, len(prompts) - 1), min_size=1, max_size=8), label="prompts")
    max_tokens = data.draw(st.lists(st.integers(1, MAX_TOKENS), min_size=len(idx), max_size=len(idx)))
    allocator = data.draw(st.sampled_from(["paged", "paged", "contiguous"]), label="allocator")
    block_size = data.draw(st.sampled_from([1, 2, 3, 5, 16]), label="block_size")
    longest = max(len(prompts[i]) + m - 1 for i, m in zip(idx, max_tokens))
    need = -(-(64 if allocator == "contiguous" else longest) // block_size)
    if allocator == "contiguous":  # the buddy arena places a reservation in a power-of-two run
        need = 1 << (need - 1).bit_length()
    num_blocks = data.draw(st.integers(need, 3 * need), label="num_blocks")
    chunk = data.draw(st.sampled_from([1, 2, 3, 7, 512]), label="max_num_batched_tokens")
    caching = data.draw(st.booleans(), label="prefix_caching")
    llm = make_llm(loaded, allocator=allocator, block_size=block_size, num_blocks=num_blocks,
                   max_num_batched_tokens=chunk, enable_prefix_caching=caching, max_model_len=64,
                   max_num_seqs=data.draw(st.integers(1, 8), label="max_num_seqs"))
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = serve(llm, [prompts[i] for i in idx], params)
    assert got == [[plain[i][0][:m]] for i, m in zip(idx, max_tokens)]


# --- sampling -----------------------------------------------------------------------------------------
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, top_k=64, seed=11, ignore_eos=True)


def test_sampling_reproducible_with_seed(loaded, prompts):
    a = serve(make_llm(loaded), prompts, SAMPLED)
    b = serve(make_llm(loaded, block_size=4, num_blocks=512), prompts[::-1], SAMPLED)[::-1]
    assert a == b
    other_seed = SamplingParams(max_tokens=8, temperature=1.0, seed=12, ignore_eos=True)
    c = serve(make_llm(loaded), prompts, other_seed)
    assert a != c  # the seed matters


def test_sampling_unseeded_follows_engine_seed(loaded, prompts):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    a = serve(make_llm(loaded, seed=5), prompts, params)
    assert serve(make_llm(loaded, seed=5), prompts, params) == a
    assert serve(make_llm(loaded, seed=6), prompts, params) != a


def _children_alone(loaded, prompt, params: SamplingParams) -> list[list[int]]:
    llm = make_llm(loaded)
    return [serve(llm, [prompt], SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, seed=params.seed + i, ignore_eos=True))[0][0] for i in range(params.n)]


@pytest.mark.parametrize("allocator", ["paged", "contiguous"])
def test_parallel_sampling_children_equal_alone(loaded, prompts, allocator):
    """Child i of n equals the request alone with seed + i; siblings share (then copy) the prompt's
    partial last block, and nobody reads another's tokens."""
    params = SamplingParams(max_tokens=8, temperature=1.0, n=4, seed=21, ignore_eos=True)
    batch = [prompts[1], prompts[5]]  # 5 and 23 tokens: partial last blocks at block size 4
    want = [_children_alone(loaded, p, params) for p in batch]
    kw = dict(block_size=4, num_blocks=64) if allocator == "paged" else dict(max_model_len=32, num_blocks=80)
    llm = make_llm(loaded, allocator=allocator, **kw)
    got = serve(llm, batch, params)
    assert got == want
    assert all(len({tuple(c) for c in children}) > 1 for children in got)  # the children really differ
    if allocator == "paged":
        m = llm.block_manager.metrics()
        assert m.forks == 6 and m.copy_on_write_copies >= 6


def test_parallel_sampling_under_preemption(loaded, prompts):
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5, ignore_eos=True)
    batch = [prompts[5], prompts[6]]
    want = [_children_alone(loaded, p, params) for p in batch]
    llm = make_llm(loaded, block_size=4, num_blocks=16, enable_prefix_caching=True)
    assert serve(llm, batch, params) == want
    assert llm.stats.num_preemptions > 0


def _seeded(max_tokens: int, n: int, prompt_index: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=32, n=n, seed=1000 * prompt_index,
                          ignore_eos=True)


@pytest.fixture(scope="module")
def children_alone(loaded, prompts) -> list[list[list[int]]]:
    """children_alone[i][j]: child j of prompt i (seed 1000 i + j) served alone, MAX_TOKENS tokens."""
    llm = make_llm(loaded)
    return [[serve(llm, [p], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=32,
                                            seed=1000 * i + j, ignore_eos=True))[0][0] for j in range(3)]
            for i, p in enumerate(prompts)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_configurations_sampled(loaded, prompts, children_alone, data):
    """Random batches of seeded n = 1..3 requests (twins included) under random block sizes, pools,
    chunks and prefix caching: child j always equals prompt i's child j served alone."""
    idx = data.draw(st.lists(st.integers(0, len(prompts) - 1), min_size=1, max_size=5), label="prompts")
    ns = data.draw(st.lists(st.integers(1, 3), min_size=len(idx), max_size=len(idx)), label="n")
    max_tokens = data.draw(st.lists(st.integers(1, MAX_TOKENS), min_size=len(idx), max_size=len(idx)))
    block_size = data.draw(st.sampled_from([1, 2, 3, 16]), label="block_size")
    longest = max(len(prompts[i]) + m - 1 for i, m in zip(idx, max_tokens))
    need = -(-longest // block_size)
    llm = make_llm(loaded, block_size=block_size, num_blocks=data.draw(st.integers(need, 3 * need)),
                   max_num_batched_tokens=data.draw(st.sampled_from([1, 3, 512]), label="chunk"),
                   enable_prefix_caching=data.draw(st.booleans(), label="prefix_caching"), max_model_len=64)
    params = [_seeded(m, n, i) for i, n, m in zip(idx, ns, max_tokens)]
    got = serve(llm, [prompts[i] for i in idx], params)
    assert got == [[children_alone[i][j][:m] for j in range(n)] for i, n, m in zip(idx, ns, max_tokens)]
