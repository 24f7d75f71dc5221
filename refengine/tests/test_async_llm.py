"""The online engine without HTTP: a request added while another runs joins the batch and gets the
offline engine's tokens, a failed step ends only the requests it touched (with the failure as their
error) and the engine serves on, and shutting down ends every open stream."""

from __future__ import annotations

import asyncio
import time

import pytest
from pagedbench.refengine import LLM, SamplingParams
from pagedbench.refengine.cli import resolve_model
from pagedbench.refengine.engine.async_llm import AsyncLLM, EngineDeadError
from pagedbench.refengine.errors import InvalidRequestError

ENGINE = dict(num_blocks=32, batch_invariant=True, seed=0)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def offline(prompt: list[int], params: SamplingParams = PARAMS) -> list[int]:
    return LLM(resolve_model("tiny"), **ENGINE).generate([prompt], params)[0].outputs[0].token_ids


async def drain(stream) -> tuple[list[int], list]:
    tokens, updates = [], []
    async for u in stream:
        updates.append(u)
        tokens += [t for d in u.deltas for t in d.token_ids]
    return tokens, updates


def test_a_request_added_mid_run_joins_and_matches_offline():
    async def run(engine):
        long = await engine.add([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        first = await long.__anext__()  # the long one is running
        late = await engine.add([4, 5, 6, 7], PARAMS)
        (late_tokens, late_updates), (rest, _) = await asyncio.gather(drain(late), drain(long))
        return [t for d in first.deltas for t in d.token_ids] + rest, late_tokens, late_updates

    with AsyncLLM(LLM(resolve_model("tiny"), **ENGINE)) as engine:
        long_tokens, late_tokens, updates = asyncio.run(run(engine))
        stats = engine.llm.stats
    assert long_tokens == offline([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    assert late_tokens == offline([4, 5, 6, 7])
    assert [d.num_output_tokens for u in updates for d in u.deltas] == list(range(1, 9))
    assert updates[-1].finished and updates[-1].deltas[-1].finish_reason == "length"
    assert stats.peak_running_seqs == 2 and stats.num_used_blocks == 0


def test_a_failed_step_ends_its_requests_with_the_error_and_the_engine_serves_on():
    llm = LLM(resolve_model("tiny"), **ENGINE)
    execute, calls = llm.executor.execute, []

    def fails_third(out):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("planted fault")
        return execute(out)

    llm.executor.execute = fails_third

    async def run(engine):
        hit = await engine.add([1, 2, 3], PARAMS)
        tokens, updates = await drain(hit)
        after = await engine.add([4, 5, 6, 7], PARAMS)
        return tokens, updates[-1], (await drain(after))[0]

    with AsyncLLM(llm) as engine:
        tokens, last, after = asyncio.run(run(engine))
        used = engine.llm.block_manager.num_used_blocks
    assert last.finished and last.error == "a step failed: RuntimeError: planted fault"
    assert last.deltas[-1].finish_reason == "abort" and len(tokens) == 2  # two steps ran before it
    assert after == offline([4, 5, 6, 7]) and used == 0


def test_a_step_that_fails_before_the_caller_reads_its_handle_is_no_rejection():
    """add() returns the stream of an accepted request even when a step has already failed it by the time
    the caller's event loop reads the engine's answer: the failure comes through the stream."""
    llm = LLM(resolve_model("tiny"), **ENGINE)
    execute = llm.executor.execute

    def fails(out):
        if out.chunks:
            raise RuntimeError("planted fault")
        return execute(out)

    llm.executor.execute = fails

    async def run(engine):
        task = asyncio.ensure_future(engine.add([1, 2, 3], PARAMS))
        await asyncio.sleep(0)  # the add is queued for the engine's thread
        time.sleep(0.5)  # this event loop busy while the engine admits the request and its step fails
        stream = await task
        return await drain(stream)

    with AsyncLLM(llm) as engine:
        tokens, updates = asyncio.run(run(engine))
    assert tokens == [] and updates[-1].finished
    assert updates[-1].error == "a step failed: RuntimeError: planted fault"


def test_rejections_and_shutdown():
    async def run(engine):
        with pytest.raises(InvalidRequestError, match="token ids outside the vocabulary"):
            await engine.add([1, 9999], PARAMS)
        open_stream = await engine.add([1, 2], SamplingParams(max_tokens=500, ignore_eos=True))
        await open_stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        _, updates = await drain(open_stream)
        with pytest.raises(EngineDeadError, match="not running"):
            await engine.add([1, 2], PARAMS)
        return updates

    engine = AsyncLLM(LLM(resolve_model("tiny"), **ENGINE)).start()
    updates = asyncio.run(run(engine))
    assert updates[-1].finished and updates[-1].deltas[-1].finish_reason == "abort"
    assert engine.llm.block_manager.num_used_blocks == 0
