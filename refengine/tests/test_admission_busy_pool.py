"""A request is refused only if it could never fit the whole KV pool; one that fits an idle pool but
arrives while the pool is busy waits and completes: through the step API, the async engine and the
server, on the paged and the contiguous allocator, and over random pool states."""

from __future__ import annotations

import asyncio

import pytest
from pagedbench.refengine import LLM, SamplingParams
from pagedbench.refengine.cli import resolve_model
from pagedbench.refengine.engine.async_llm import AsyncLLM
from pagedbench.refengine.errors import InvalidRequestError

BS = 16
NUM_BLOCKS = 16
ENGINE = dict(num_blocks=NUM_BLOCKS, block_size=BS, max_model_len=1024, batch_invariant=True, seed=0)


def prompt(n: int, start: int = 1) -> list[int]:
    return [(start + i) % 400 + 1 for i in range(n)]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def alone(ids: list[int], max_tokens: int, **engine) -> list[int]:
    llm = LLM(resolve_model("tiny"), **{**ENGINE, **engine})
    return llm.generate([ids], params(max_tokens))[0].outputs[0].token_ids


# Holds 11 of the 16 blocks while it runs (160 prompt tokens + up to 15 more).
HOLDER = (prompt(160), 16)
# Needs 12 blocks (180 + 10 - 1 = 189 tokens): fits the idle pool, not the 5 blocks left beside HOLDER.
LATE = (prompt(180, start=7), 10)


def test_step_api_queues_a_fitting_request_while_the_pool_is_busy():
    llm = LLM(resolve_model("tiny"), **ENGINE, check_invariants=True)
    holder = llm.add_request(HOLDER[0], params(HOLDER[1]))
    llm.step()
    assert llm.block_manager.num_free_blocks < 12  # the late request cannot be admitted now
    late = llm.add_request(LATE[0], params(LATE[1]))
    assert late.error is None
    while llm.scheduler.has_unfinished():
        llm.step()
    assert holder.output().outputs[0].token_ids == alone(*HOLDER)
    assert late.output().outputs[0].token_ids == alone(*LATE)
    assert llm.block_manager.num_free_blocks == NUM_BLOCKS


def test_a_request_that_never_fits_is_refused_at_once_busy_or_idle():
    llm = LLM(resolve_model("tiny"), **ENGINE)
    too_big = (prompt(250), 8)  # 257 tokens: 17 blocks of a 16-block pool
    idle = llm.add_request(too_big[0], params(too_big[1]))
    assert "can never fit the KV pool: 257 tokens" in idle.error
    llm.add_request(HOLDER[0], params(HOLDER[1]))
    llm.step()
    busy = llm.add_request(too_big[0], params(too_big[1]))
    assert busy.error == idle.error
    # exactly the whole pool fits: 256 tokens, 16 blocks
    assert llm.add_request(prompt(249), params(8)).error is None


def test_the_watermark_counts_against_the_whole_pool():
    # a preempted sequence comes back whole under the watermark: one of the pool's size less the watermark
    # would wait for ever, so it is refused, naming the watermark
    llm = LLM(resolve_model("tiny"), **ENGINE, watermark_blocks=2)
    refused = llm.add_request(prompt(230), params(8))  # 237 tokens: 15 blocks > 16 - 2
    assert "can never fit the KV pool" in refused.error and "2 of them kept free by watermark_blocks" in refused.error
    assert llm.add_request(prompt(215), params(8)).error is None  # 222 tokens: 14 blocks


def test_contiguous_allocator_queues_what_fits_the_empty_arena():
    # the contiguous LLM reserves max_model_len per request: 64 tokens = 4 blocks of a 16-block arena, so
    # four fit together, and a fifth waits for one to leave
    engine = dict(ENGINE, max_model_len=64, allocator="contiguous")
    llm = LLM(resolve_model("tiny"), **engine)
    reqs = [llm.add_request(prompt(20, start=s), params(12)) for s in range(4)]
    llm.step()
    assert len(llm.scheduler.running) == 4 and not llm.block_manager.can_allocate(20)
    reqs.append(llm.add_request(prompt(20, start=4), params(12)))
    assert all(r.error is None for r in reqs)
    while llm.scheduler.has_unfinished():
        llm.step()
    for s, r in enumerate(reqs):
        assert r.output().outputs[0].token_ids == alone(prompt(20, start=s), 12, **engine)


def test_async_engine_queues_a_fitting_request_while_the_pool_is_busy():
    async def run(engine):
        holder = await engine.add(HOLDER[0], params(HOLDER[1]))
        first = await holder.__anext__()  # the holder is running, holding 11 blocks
        late = await engine.add(LATE[0], params(LATE[1]))

        async def drain(stream):
            return [t async for u in stream for d in u.deltas for t in d.token_ids]

        rest, late_tokens = await asyncio.gather(drain(holder), drain(late))
        return [t for d in first.deltas for t in d.token_ids] + rest, late_tokens

    with AsyncLLM(LLM(resolve_model("tiny"), **ENGINE)) as engine:
        holder_tokens, late_tokens = asyncio.run(run(engine))
        assert engine.llm.block_manager.num_used_blocks == 0
    assert holder_tokens == alone(*HOLDER)
    assert late_tokens == alone(*LATE)


def test_server_queues_a_fitting_request_while_the_pool_is_busy():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from pagedbench.refengine.server.launch import start_in_thread

    running = start_in_thread(LLM(resolve_model("tiny"), **ENGINE), model_name="tiny")
    try:
        with httpx.Client(base_url=running.url, timeout=httpx.Timeout(30.0)) as client:
            body = {"prompt": HOLDER[0], "max_tokens": HOLDER[1], "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data: "))  # the holder is running
                late = client.post("/v1/completions",
                                   json={"prompt": LATE[0], "max_tokens": LATE[1], "ignore_eos": True,
                                         "temperature": 0})
                for _ in lines:
                    pass
            never = client.post("/v1/completions", json={"prompt": prompt(250), "max_tokens": 8})
    finally:
        running.stop()
    assert late.status_code == 200, late.text
    assert late.json()["choices"][0]["token_ids"] == alone(*LATE)
    assert never.status_code == 400 and "can never fit the KV pool" in never.json()["error"]["message"]


def test_strict_generate_raises_only_for_never_fitting():
    llm = LLM(resolve_model("tiny"), **ENGINE)
    with pytest.raises(InvalidRequestError, match="can never fit"):
        llm.generate([HOLDER[0], prompt(250)], [params(HOLDER[1]), params(8)], strict=True)


def test_soak_through_the_async_engine_refuses_no_fitting_request_and_leaks_nothing():
    # requests of random sizes (up to the whole pool) added while others run, so most arrive at a full
    # pool; every one that fits the idle pool must complete, every other be refused, no block kept
    import random

    rng = random.Random(5)
    sizes = [(rng.randint(4, 240), rng.randint(1, 20)) for _ in range(40)]

    async def run(engine):
        async def one(i, n, m):
            await asyncio.sleep(rng.random() * 0.05)
            try:
                stream = await engine.add(prompt(n, start=i), params(m))
            except InvalidRequestError as e:
                return "refused", str(e)
            tokens = [t async for u in stream for d in u.deltas for t in d.token_ids]
            return "done", tokens

        return await asyncio.gather(*(one(i, n, m) for i, (n, m) in enumerate(sizes)))

    with AsyncLLM(LLM(resolve_model("tiny"), **ENGINE, check_invariants=True)) as engine:
        results = asyncio.run(run(engine))
        assert engine.llm.block_manager.num_used_blocks == 0
    for (n, m), (what, body) in zip(sizes, results):
        fits = -(-(n + m - 1) // BS) <= NUM_BLOCKS
        assert what == ("done" if fits else "refused"), (n, m, body)
        if fits:
            assert len(body) == m
    assert sum(what == "done" for what, _ in results) >= 30
