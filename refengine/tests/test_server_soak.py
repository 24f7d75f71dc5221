"""A bounded soak through HTTP: many concurrent requests of random sizes, ``n``, stop strings, logprobs
and streaming on a pool small enough that most arrive while it is full and some preempt others. Every
request that fits the idle pool is answered 200 with the tokens the offline engine gives it alone;
afterwards no KV block is held and the server is healthy."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from pagedbench.refengine import LLM, SamplingParams  # noqa: E402
from pagedbench.refengine.server.launch import start_in_thread  # noqa: E402
from pagedbench.refengine.tests.test_stop_strings import WORDS, words_folder  # noqa: E402, F401  (the fixture)

# 20 blocks x 4 = 80 slots: one request (prompt up to 24, up to 40 new tokens) can take most of the pool
ENGINE = dict(seed=0, num_blocks=20, block_size=4, batch_invariant=True)
NUM_REQUESTS, CONCURRENCY = 48, 8


def make_requests(seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(NUM_REQUESTS):
        body = {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24))),
                "max_tokens": rng.randint(1, 40), "temperature": 0, "ignore_eos": True,
                "n": rng.choice([1, 1, 2]), "stream": rng.random() < 0.5}
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(WORDS)]
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
        out.append(body)
    return out


async def send(client: httpx.AsyncClient, body: dict) -> tuple[int, list[list[int]], list[str]]:
    n = body["n"]
    ids, texts = [[] for _ in range(n)], [""] * n
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return r.status_code, [], []
        return 200, [c["token_ids"] for c in r.json()["choices"]], [c["text"] for c in r.json()["choices"]]
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, [], []
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids[c["index"]] += c["token_ids"]
                    texts[c["index"]] += c["text"]
    return 200, ids, texts


def test_a_concurrent_soak_serves_every_fitting_request_exactly(words_folder):  # noqa: F811
    bodies = make_requests(11)
    llm = LLM(str(words_folder), **ENGINE, check_invariants=True)
    running = start_in_thread(llm, model_name="words", model_folder=str(words_folder))

    async def run():
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=running.url, timeout=60.0) as client:
            async def one(body):
                async with gate:
                    return await send(client, body)
            return await asyncio.gather(*(one(b) for b in bodies))

    try:
        results = asyncio.run(run())
        health = httpx.get(f"{running.url}/health", timeout=10.0).status_code
        preemptions = llm.stats.num_preemptions
        assert llm.block_manager.num_used_blocks == 0
    finally:
        running.stop()
    assert health == 200
    offline = LLM(str(words_folder), **ENGINE)
    for body, (status, ids, texts) in zip(bodies, results):
        assert status == 200, body
        params = SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True, n=body["n"],
                                stop=body.get("stop", ()), logprobs=body.get("logprobs"))
        want = offline.generate([body["prompt"]], params, use_tqdm=False)[0].outputs
        assert ids == [w.token_ids for w in want], body
        assert texts == [w.text for w in want], body
    assert preemptions > 0  # the pool was tight enough to preempt: the soak exercised recompute
