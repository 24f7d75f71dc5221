"""The server with a model folder's tokenizer and chat template: text prompts, chat messages rendered
by the template, streamed text pieces that add up to the whole response's text."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from pagedbench.refengine import LLM, SamplingParams  # noqa: E402
from pagedbench.refengine.server.launch import start_in_thread  # noqa: E402
from pagedbench.refengine.tests.test_cli import folder  # noqa: E402, F401  (the HF folder fixture)


@pytest.fixture(scope="module")
def text_server(folder):  # noqa: F811
    running = start_in_thread(LLM(str(folder), seed=0), model_name="words", model_folder=str(folder))
    try:
        with httpx.Client(base_url=running.url, timeout=20.0) as client:
            yield client, folder
    finally:
        running.stop()


def events(response) -> list:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def test_chat_renders_the_template_and_streams_the_same_text(text_server):
    client, hf_folder = text_server
    body = {"model": "words", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    llm = LLM(str(hf_folder), seed=0)
    # the template's rendering of one user turn: BOS USER hello world ASSISTANT
    want = llm.generate([{"prompt_token_ids": [1, 2, 4, 5, 3]}], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert choice["token_ids"] == want.outputs[0].token_ids
    assert choice["message"] == {"role": "assistant", "content": llm.tokenizer.decode(want.outputs[0].token_ids)}
    assert whole.json()["usage"]["prompt_tokens"] == 5
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = events(r)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_text_completion_streams_its_text(text_server):
    client, _ = text_server
    body = {"prompt": "hello world hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        streamed = "".join(c["choices"][0]["text"] for c in events(r))
    assert whole["text"] and streamed == whole["text"]


def test_chat_refuses_non_text_content(text_server):
    client, _ = text_server
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and "only text parts are served" in r.json()["error"]["message"]


def test_the_default_max_tokens_shrinks_to_the_context(text_server):
    client, _ = text_server  # max_model_len 64: a 62-token prompt leaves 2 of the default 16
    r = client.post("/v1/completions", json={"prompt": "hello " * 62, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 2
    r = client.post("/v1/completions", json={"prompt": "hello " * 62, "max_tokens": 3})
    assert r.status_code == 400 and "you requested 65 tokens (62 in the prompt, 3 in the completion)" in r.text


def test_a_lone_surrogate_in_a_message_is_a_400(text_server):
    client, _ = text_server
    r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages[0].content: not valid Unicode")


def test_tokenize_and_detokenize(text_server):
    client, _ = text_server
    r = client.post("/tokenize", json={"prompt": "hello world hello"}).json()
    assert r == {"count": 3, "max_model_len": 64, "tokens": [4, 5, 4], "token_strs": None}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hello world"}]}).json()
    assert chat["tokens"] == [1, 2, 4, 5, 3] and chat["count"] == 5  # BOS USER hello world ASSISTANT
    assert client.post("/detokenize", json={"tokens": [4, 5]}).json() == {"prompt": "hello world"}
    bad = client.post("/detokenize", json={"tokens": [4, 99]})
    assert bad.status_code == 400 and "outside the vocabulary [0, 16): [99]" in bad.json()["error"]["message"]
    both = client.post("/tokenize", json={"prompt": "hello", "messages": [{"role": "user", "content": "x"}]})
    assert both.status_code == 400 and "exactly one of 'prompt' and 'messages'" in both.text


def test_generation_config_sets_the_defaults_a_request_leaves_out(folder, tmp_path):  # noqa: F811
    import shutil

    from pagedbench.refengine.server.protocol import ChatRequest, CompletionRequest, generation_defaults

    model = tmp_path / "model"
    shutil.copytree(folder, model)
    (model / "generation_config.json").write_text('{"temperature": 0.0, "top_p": 0.9, "top_k": "x"}')
    assert generation_defaults(str(model)) == {"temperature": 0.0, "top_p": 0.9}  # a bad top_k is left out
    assert generation_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.7}')
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.0}
    explicit = CompletionRequest(prompt=[1], temperature=0.5).sampling_params(4, {"temperature": 0.0})
    assert explicit.temperature == 0.5  # the request's own value wins
    assert CompletionRequest(prompt=[1]).sampling_params(4, {}).temperature == 1.0  # OpenAI's default
    chat = ChatRequest(messages=[{"role": "user", "content": "hi"}]).sampling_params(4, {"top_p": 0.5})
    assert chat.top_p == 0.5  # chat too

    llm = LLM(str(model), seed=0)
    greedy = llm.generate(["hello world"], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].token_ids
    running = start_in_thread(LLM(str(model), seed=0), model_name="words", model_folder=str(model))
    try:
        with httpx.Client(base_url=running.url, timeout=httpx.Timeout(20.0)) as client:
            got = [client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 8, "seed": s})
                   .json()["choices"][0]["token_ids"] for s in (1, 2)]
    finally:
        running.stop()
    assert got == [greedy, greedy]  # no temperature in the request: the folder's greedy, whatever the seed
