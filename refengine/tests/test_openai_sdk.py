"""The official ``openai`` SDK drives the server unchanged: models, completions (a batch, stop strings,
logprobs, echo), chat (streamed, with logprobs) and errors, each checked against the offline engine or
the raw HTTP response. The SDK's own parsing is part of what is tested: a field of the wrong shape
fails here even where the raw-JSON tests pass."""

from __future__ import annotations

import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from pagedbench.refengine import LLM, SamplingParams  # noqa: E402
from pagedbench.refengine.server.launch import start_in_thread  # noqa: E402
from pagedbench.refengine.tests.test_stop_strings import words_folder  # noqa: E402, F401  (the fixture)

ENGINE = dict(seed=0, num_blocks=32, block_size=4)


@pytest.fixture(scope="module")
def sdk(words_folder):  # noqa: F811
    llm = LLM(str(words_folder), **ENGINE)
    execute = llm.executor.execute

    def floored(out):  # a step of at least 5 ms: a 60-token stream outlasts the client that leaves it
        time.sleep(0.005)
        return execute(out)

    llm.executor.execute = floored
    running = start_in_thread(llm, model_name="words", model_folder=str(words_folder))
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=20.0, max_retries=0)
    try:
        yield client, LLM(str(words_folder), **ENGINE)
    finally:
        client.close()
        running.stop()


def test_models_list_and_retrieve(sdk):
    client, _offline = sdk
    assert [m.id for m in client.models.list()] == ["words"]
    assert client.models.retrieve("words").id == "words"
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-5' does not exist"):
        client.models.retrieve("gpt-5")


def test_completions_with_stop_logprobs_and_a_batch(sdk):
    client, offline = sdk
    free = offline.generate(["the cat sat"], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    stop = free.outputs[0].text.split(" ")[4]
    want = offline.generate(["the cat sat"], SamplingParams(max_tokens=10, ignore_eos=True, stop=[stop],
                                                            logprobs=2), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model="words", prompt="the cat sat", max_tokens=10, temperature=0, stop=[stop],
                                  logprobs=2, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, "stop")
    assert choice.logprobs.token_logprobs == pytest.approx([e[t] for t, e in zip(want.token_ids, want.logprobs)],
                                                           abs=1e-5)
    assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs)
    assert r.usage.completion_tokens == len(want.token_ids)
    batch = client.completions.create(model="words", prompt=["the cat sat", "red sun"], max_tokens=3, temperature=0,
                                      echo=True)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text.startswith("the cat sat") and batch.choices[1].text.startswith("red sun")


def test_a_streamed_chat_with_logprobs(sdk):
    client, _offline = sdk
    messages = [{"role": "user", "content": "a dog ran"}]
    whole = client.chat.completions.create(model="words", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    pieces, tokens = [], []
    with client.chat.completions.create(model="words", messages=messages, max_tokens=6, temperature=0, stream=True,
                                        logprobs=True, top_logprobs=3,
                                        stream_options={"include_usage": True}) as stream:
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                tokens += [c.token for c in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
            else:
                assert chunk.usage.completion_tokens == 6
    assert "".join(pieces) == whole.choices[0].message.content
    assert tokens == [c.token for c in content]


def test_bad_requests_raise_the_sdks_errors(sdk):
    client, _ = sdk
    with pytest.raises(openai.BadRequestError, match="maximum context length is 64 tokens"):
        client.completions.create(model="words", prompt="the " * 60, max_tokens=10)
    with pytest.raises(openai.BadRequestError, match="unsupported by this server: tools"):
        client.chat.completions.create(model="words", messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="words", prompt="the", max_tokens=0)


def test_n_completions_and_a_cancelled_stream_frees_its_blocks(sdk, words_folder):  # noqa: F811
    client, offline = sdk
    r = client.completions.create(model="words", prompt="a dog ran", max_tokens=5, temperature=1.0, seed=3, n=3,
                                  extra_body={"ignore_eos": True})
    want = offline.generate(["a dog ran"], SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3,
                                                          ignore_eos=True), use_tqdm=False)[0].outputs
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w.text for w in want]
    # a long stream left after its first chunk: the server aborts it and frees its KV blocks
    stream = client.completions.create(model="words", prompt="the cat", max_tokens=60, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    base = str(client.base_url).removesuffix("/v1/")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics", timeout=5).text
        usage = float(next(line for line in text.splitlines()
                           if line.startswith("pagedbench:kv_cache_usage_perc")).split()[-1])
        if usage == 0.0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the cancelled stream still holds KV blocks: usage {usage}")
    aborted = [line for line in text.splitlines()
               if line.startswith("pagedbench:request_success_total") and 'finished_reason="abort"' in line]
    assert aborted and float(aborted[0].split()[-1]) >= 1  # it was cut, not run to its end
