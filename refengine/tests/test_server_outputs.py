"""What the server returns beyond tokens, checked against the offline engine: stop strings (the text cut
where the engine cut it, and a stream that never sends text it would take back), logprobs in both of the
API's shapes, ``echo``, and a batch of prompts in one ``/v1/completions`` call."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from pagedbench.refengine import LLM, SamplingParams  # noqa: E402
from pagedbench.refengine.server.launch import start_in_thread  # noqa: E402
from pagedbench.refengine.tests.test_stop_strings import words_folder  # noqa: E402, F401  (the fixture)

ENGINE = dict(seed=0, num_blocks=32, block_size=4)


@pytest.fixture(scope="module")
def served(words_folder):  # noqa: F811
    running = start_in_thread(LLM(str(words_folder), **ENGINE), model_name="words", model_folder=str(words_folder))
    offline = LLM(str(words_folder), **ENGINE)
    try:
        with httpx.Client(base_url=running.url, timeout=20.0) as client:
            yield client, offline
    finally:
        running.stop()


def events(response) -> list:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def stream(client, path, body) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return events(r)


def engine_out(offline, prompt, **kw):
    return offline.generate([prompt], SamplingParams(ignore_eos=True, **kw), use_tqdm=False)[0].outputs


PROMPT = "the cat sat on"


def test_stop_strings_cut_the_text_where_the_engine_does_whole_and_streamed(served):
    client, offline = served
    free = engine_out(offline, PROMPT, max_tokens=12)[0]
    words = free.text.split(" ")
    # a stop that straddles two tokens, and a later whole word: the earliest wins
    stops = [f"{words[3][-1]} {words[4][:1]}", words[6]]
    want = engine_out(offline, PROMPT, max_tokens=12, stop=stops)[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 12
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": stops}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (whole["text"], whole["token_ids"], whole["finish_reason"]) == (want.text, want.token_ids, "stop")
    chunks = stream(client, "/v1/completions", body)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == want.text  # nothing sent was taken back: the stop string never left
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.token_ids
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    kept = client.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert kept["text"] == engine_out(offline, PROMPT, max_tokens=12, stop=stops,
                                      include_stop_str_in_output=True)[0].text


def test_chat_stops_on_a_string_too(served):
    client, _ = served
    body = {"messages": [{"role": "user", "content": "a dog ran"}], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    free = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    stop = free.split(" ")[3]
    got = client.post("/v1/chat/completions", json={**body, "stop": stop}).json()["choices"][0]
    assert got["finish_reason"] == "stop" and got["message"]["content"] == free[:free.index(stop)]
    streamed = stream(client, "/v1/chat/completions", {**body, "stop": stop})
    assert "".join(c["choices"][0]["delta"]["content"] for c in streamed) == got["message"]["content"]


def test_completion_logprobs_are_the_engines_in_openais_legacy_shape(served):
    client, offline = served
    want = engine_out(offline, PROMPT, max_tokens=6, logprobs=3)[0]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    tok = offline.tokenizer
    assert lp["tokens"] == [tok.decode([t]) for t in want.token_ids]
    assert lp["token_logprobs"] == pytest.approx([e[t] for t, e in zip(want.token_ids, want.logprobs)], abs=1e-5)
    for top, entry in zip(lp["top_logprobs"], want.logprobs):
        assert top == pytest.approx({tok.decode([t]): v for t, v in entry.items()}, abs=1e-5)
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    chunks = stream(client, "/v1/completions", body)
    assert [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])] == lp["tokens"]
    assert [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])] == \
        lp["text_offset"]


def test_chat_logprobs_list_the_top_k_in_order(served):
    client, offline = served
    body = {"messages": [{"role": "user", "content": "red sun"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    prompt_ids = client.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    want = engine_out(offline, {"prompt_token_ids": prompt_ids}, max_tokens=5, logprobs=2)[0]
    assert [c["token"] for c in content] == [offline.tokenizer.decode([t]) for t in want.token_ids]
    for c, t, entry in zip(content, want.token_ids, want.logprobs):
        assert c["logprob"] == pytest.approx(entry[t], abs=1e-5)
        assert c["bytes"] == list(c["token"].encode())
        best = sorted(entry.values(), reverse=True)[:2]
        assert [x["logprob"] for x in c["top_logprobs"]] == pytest.approx(best, abs=1e-5)
    off = {k: v for k, v in body.items() if k != "top_logprobs"}
    assert client.post("/v1/chat/completions", json={**off, "logprobs": False}).json()["choices"][0][
        "logprobs"] is None
    r = client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": 2})
    assert r.status_code == 400 and "top_logprobs needs logprobs: true" in r.text


def test_echo_puts_the_prompt_before_the_text(served):
    client, offline = served
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == PROMPT + plain
    ids = offline.tokenizer.encode(PROMPT).ids
    by_ids = client.post("/v1/completions", json={**body, "prompt": ids, "echo": True}).json()["choices"][0]
    assert by_ids["text"] == offline.tokenizer.decode(ids) + plain
    assert "".join(c["choices"][0]["text"] for c in stream(client, "/v1/completions", {**body, "echo": True})) \
        == PROMPT + plain


def test_a_batch_of_prompts_is_one_request_each_numbered_prompt_by_prompt(served):
    client, offline = served
    prompts = ["the cat sat", "a dog ran far", "red sun up"]
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2}
    singles = [client.post("/v1/completions", json={**body, "prompt": p}).json() for p in prompts]
    batch = client.post("/v1/completions", json={**body, "prompt": prompts}).json()
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    assert [c["text"] for c in batch["choices"]] == [c["text"] for s in singles for c in s["choices"]]
    for key in ("prompt_tokens", "completion_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)
    chunks = stream(client, "/v1/completions", {**body, "prompt": prompts,
                                                "stream_options": {"include_usage": True}})
    texts = [""] * 6
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in batch["choices"]]
    assert chunks[-1]["usage"] == batch["usage"]
    ids = [offline.tokenizer.encode(p).ids for p in prompts]
    by_ids = client.post("/v1/completions", json={**body, "prompt": ids}).json()
    assert [c["token_ids"] for c in by_ids["choices"]] == [c["token_ids"] for c in batch["choices"]]


def test_a_refused_prompt_in_a_batch_refuses_the_batch_and_frees_what_it_queued(served):
    client, _ = served
    aborted = abort_count(client)
    # the second prompt passes the server's checks and is refused by the engine, after the first was queued
    r = client.post("/v1/completions", json={"prompt": [[1, 2, 3], [2, 99]], "max_tokens": 30, "ignore_eos": True})
    assert r.status_code == 400 and "outside the vocabulary" in r.text, r.text
    metrics = client.get("/metrics").text
    used = [line for line in metrics.splitlines() if line.startswith("pagedbench:kv_cache_usage_perc")]
    assert used and float(used[0].split()[-1]) == 0.0
    assert abort_count(client) == aborted + 1


def abort_count(client) -> float:
    lines = [line for line in client.get("/metrics").text.splitlines()
             if line.startswith("pagedbench:request_success_total") and 'finished_reason="abort"' in line]
    return float(lines[0].split()[-1]) if lines else 0.0
