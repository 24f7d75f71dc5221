"""The OpenAI-compatible server over HTTP (httpx against uvicorn on 127.0.0.1, a free port): whole and
streamed completions equal the offline engine's, concurrent streams, a client that leaves mid-stream
(or mid-response) frees its KV blocks, bad requests get OpenAI error bodies and leave the server up,
and ``/metrics`` moves as requests run. Every wait is bounded by a deadline or a client timeout."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from pagedbench.refengine import LLM, SamplingParams  # noqa: E402
from pagedbench.refengine.cli import resolve_model  # noqa: E402
from pagedbench.refengine.server.launch import start_in_thread  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

# 48 blocks x 16 = 768 slots < max_model_len 1024: a long enough prompt can never fit the pool
ENGINE = dict(num_blocks=48, max_model_len=1024, batch_invariant=True, seed=0)
TIMEOUT = httpx.Timeout(20.0)


STEP_FLOOR_S = 0.002  # the server's steps take at least this long (see the fixture)


@pytest.fixture(scope="module")
def server():
    llm = LLM(resolve_model("tiny"), **ENGINE)
    # tiny's steps can take well under a millisecond on a fast machine: a floor on the step time keeps
    # the tests' windows (a scrape while a request runs, 700 tokens outlasting a client's 0.3 s) machine
    # independent. The sleep releases the GIL, as the model's kernels do.
    execute = llm.executor.execute

    def floored(out):
        time.sleep(STEP_FLOOR_S)
        return execute(out)

    llm.executor.execute = floored
    running = start_in_thread(llm, model_name="tiny")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def offline(prompt: list[int], max_tokens: int) -> list[int]:
    """The same model's greedy tokens from the offline engine (alone in its batch)."""
    llm = LLM(resolve_model("tiny"), **ENGINE)
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].outputs[0].token_ids


def sse_events(lines) -> list:
    """The JSON bodies of an SSE stream, ``"[DONE]"`` kept as the string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metrics(client) -> dict[str, float]:
    """``name{labels}`` -> value of every sample on /metrics (label model_name left out)."""
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def completion(prompt, max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


def test_whole_and_streamed_completions_equal_the_offline_engine(client):
    prompt, n = [5, 6, 7, 8, 9], 6
    want = offline(prompt, n)
    whole = client.post("/v1/completions", json=completion(prompt, n))
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert [(c["token_ids"], c["finish_reason"]) for c in body["choices"]] == [(want, "length")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    with client.stream("POST", "/v1/completions",
                       json=completion(prompt, n, stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in want]  # one event per token
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (n - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client):
    prompt = [(7 * i + 3) % 50 + 1 for i in range(40)]  # two whole 16-token blocks and 8 tokens more
    llm = LLM(resolve_model("tiny"), **ENGINE)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    want = [llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens for _ in range(2)]
    assert want == [0, 32]
    got = [client.post("/v1/completions", json=completion(prompt, 2)).json()["usage"] for _ in range(2)]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in got] == want
    with client.stream("POST", "/v1/completions",
                       json=completion(prompt, 2, stream=True, stream_options={"include_usage": True})) as r:
        usage = sse_events(r.iter_lines())[-2]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}


def test_parallel_sampling_streams_each_choice(client):
    prompt, n = [3, 1, 4, 1, 5], 5
    body = completion(prompt, n, n=2, temperature=1.0, seed=11)
    llm = LLM(resolve_model("tiny"), **ENGINE)
    want = [c.token_ids for c in llm.generate([prompt], SamplingParams(
        n=2, temperature=1.0, seed=11, max_tokens=n, ignore_eos=True))[0].outputs]
    assert want[0] != want[1]
    whole = client.post("/v1/completions", json=body).json()
    assert [(c["index"], c["token_ids"]) for c in whole["choices"]] == [(0, want[0]), (1, want[1])]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())[:-1]
    streamed = {0: [], 1: []}
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] += c["token_ids"]
    assert streamed == {0: want[0], 1: want[1]}


def test_concurrent_streams_share_the_batch(server):
    prompts = [[i + 1] * (3 + i) for i in range(6)]
    n = 12

    async def one(client, prompt):
        async with client.stream("POST", "/v1/completions", json=completion(prompt, n, stream=True)) as r:
            events = sse_events([line async for line in r.aiter_lines()])
        return [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    peak_before = server.engine.llm.stats.peak_running_seqs
    got = asyncio.run(all_at_once())
    assert got == [offline(p, n) for p in prompts]  # batch-invariant engine: alone == in a batch
    assert server.engine.llm.stats.peak_running_seqs >= 3 > peak_before or peak_before >= 3


def _abort_count(m) -> float:
    return m.get("pagedbench:request_success_total{finished_reason=abort}", 0.0)


def wait_for_abort(client, before: dict) -> dict:
    """The metrics once the server counted one more abort and the engine runs nothing (bounded wait)."""
    after = wait_for(lambda: (m := metrics(client)) and _abort_count(m) > _abort_count(before)
                     and m["pagedbench:num_requests_running"] == 0 and m)
    assert after, "the request was not aborted after its client left"
    # 700 tokens asked for (>= 1.4 s of steps): ending by itself would generate them all
    generated = after["pagedbench:generation_tokens_total"] - before["pagedbench:generation_tokens_total"]
    assert generated < 300
    return after


def test_a_client_leaving_mid_stream_aborts_and_frees_its_blocks(client):
    before = metrics(client)
    with client.stream("POST", "/v1/completions", json=completion([1, 2, 3, 4], 700, stream=True)) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(6)]  # three events, each followed by a blank line
        assert sum(line.startswith("data: ") for line in first) == 3
    # closed after 3 of 700 tokens: the engine must end it now, not run the other ~700 steps
    after = wait_for_abort(client, before)
    assert after["pagedbench:kv_cache_used_blocks"] == 0 and after["pagedbench:num_requests_waiting"] == 0


def test_a_client_leaving_a_whole_response_aborts_it(server, client):
    before = metrics(client)
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(0.3)) as impatient, \
            pytest.raises(httpx.ReadTimeout):
        impatient.post("/v1/completions", json=completion([1, 2, 3, 4], 700))
    after = wait_for_abort(client, before)
    assert after["pagedbench:kv_cache_used_blocks"] == 0


BAD = {
    "text-without-tokenizer": ("/v1/completions", {"prompt": "hello"}, 400,
                               "a text prompt needs a tokenizer; the model has none (pass token ids)"),
    "unknown-model": ("/v1/completions", {"model": "gpt-5", "prompt": [1]}, 404,
                      "the model 'gpt-5' does not exist; this server serves 'tiny'"),
    "no-prompt": ("/v1/completions", {"max_tokens": 3}, 422, "invalid request body: prompt: Field required"),
    "prompt-not-a-list": ("/v1/completions", {"prompt": 3}, 422, "invalid request body: prompt"),
    "negative-max-tokens": ("/v1/completions", {"prompt": [1], "max_tokens": 0}, 422, "max_tokens"),
    "never-fits-the-pool": ("/v1/completions", {"prompt": [1] * 800, "max_tokens": 4}, 400,
                            "can never fit the KV pool"),
    "outside-vocabulary": ("/v1/completions", {"prompt": [1, 512]}, 400, "outside the vocabulary [0, 512)"),
    "min-above-max": ("/v1/completions", {"prompt": [1], "max_tokens": 2, "min_tokens": 3}, 400,
                      "min_tokens must be an int in [0, max_tokens=2], got 3"),
    "stop-strings-without-a-tokenizer": ("/v1/completions", {"prompt": [1], "stop": ["\n"]}, 400,
                                         "stop strings need a tokenizer; the model has none (use stop_token_ids)"),
    "empty-stop-string": ("/v1/completions", {"prompt": [1], "stop": ["a", ""]}, 400, "stop strings must be non-empty"),
    "a-batch-with-a-bad-prompt": ("/v1/completions", {"prompt": [[1], [2, 512]]}, 400,
                                  "outside the vocabulary [0, 512)"),
    "too-many-logprobs": ("/v1/completions", {"prompt": [1], "logprobs": 21}, 400,
                          "logprobs must be in [0, 20], got 21"),
    "logprobs-true-on-completions": ("/v1/completions", {"prompt": [1], "logprobs": True}, 400,
                                     "logprobs of /v1/completions is the number of top tokens (an int), got true"),
    "echo-with-logprobs": ("/v1/completions", {"prompt": [1], "echo": True, "logprobs": 1}, 400,
                           "echo with logprobs needs the prompt's logprobs"),
    "chat-without-template": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400,
                              "model 'tiny' has no tokenizer and no chat template"),
    "unknown-path": ("/v1/embeddings", {"input": "x"}, 404, "POST /v1/embeddings: Not Found"),
    "past-the-context": ("/v1/completions", {"prompt": [1] * 1000, "max_tokens": 30}, 400,
                         "maximum context length is 1024 tokens. However, you requested 1030 tokens "
                         "(1000 in the prompt, 30 in the completion)"),
    "max-tokens-beyond-64-bits": ("/v1/completions", {"prompt": [1], "max_tokens": 2**70}, 422, "max_tokens"),
    "token-beyond-64-bits": ("/v1/completions", {"prompt": [1, 2**64]}, 422, "prompt"),
    "seed-beyond-64-bits": ("/v1/completions", {"prompt": [1], "seed": 2**64}, 422, "seed"),
    "tools": ("/v1/completions", {"prompt": [1], "tools": [{"type": "function", "function": {"name": "f"}}]},
              400, "unsupported by this server: tools"),
    "tool-choice": ("/v1/completions", {"prompt": [1], "tool_choice": "auto"}, 400,
                    "unsupported by this server: tool_choice"),
    "response-format": ("/v1/completions", {"prompt": [1], "response_format": {"type": "json_object"}}, 400,
                        "unsupported by this server: response_format"),
    "logit-bias": ("/v1/completions", {"prompt": [1], "logit_bias": {"5": 100}}, 400,
                   "unsupported by this server: logit_bias"),
    # JSON allows the escape; no tokenizer can encode it (bytes: httpx will not send it as a str)
    "lone-surrogate": ("/v1/completions", b'{"prompt": "\\ud800"}', 400, "prompt: not valid Unicode"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_get_openai_errors_and_the_server_stays_up(client, case):
    path, body, status, message = BAD[case]
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["code"] == status and error["type"]
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json=completion([1, 2], 2))
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_fields_left_off_are_served(client):
    # the "off" value of an unsupported field is no reason to refuse a request (clients send defaults)
    r = client.post("/v1/completions", json=completion([1, 2], 2, tools=[], tool_choice="none", logit_bias={},
                                                       response_format={"type": "text"}, user="me"))
    assert r.status_code == 200, r.text


def test_models_lists_the_served_model(client):
    data = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data] == [("tiny", "model", 1024)]


def test_a_model_is_retrieved_by_name(client):
    card = client.get("/v1/models/tiny")
    assert card.status_code == 200 and card.json() == client.get("/v1/models").json()["data"][0]
    r = client.get("/v1/models/gpt-5")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "the model 'gpt-5' does not exist" in r.json()["error"]["message"]


def test_tokenize_without_a_tokenizer_is_a_400(client):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "model 'tiny' has no tokenizer" in r.json()["error"]["message"]


def test_metrics_move_as_requests_run(client):
    before = metrics(client)
    with client.stream("POST", "/v1/completions", json=completion([9, 8, 7], 150, stream=True)) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        during = metrics(client)  # the request holds blocks and runs until its 150th token (>= 0.3 s)
        rest = sse_events(lines)
    assert rest[-1] == "[DONE]"
    assert during["pagedbench:num_requests_running"] == 1 and during["pagedbench:kv_cache_used_blocks"] >= 1
    assert 0 < during["pagedbench:kv_cache_usage_perc"] <= 1
    after = wait_for(lambda: (m := metrics(client))["pagedbench:time_to_first_token_seconds_count"]
                     > before.get("pagedbench:time_to_first_token_seconds_count", 0) and m)
    assert after, "the finished request was not observed"
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert after["pagedbench:num_requests_running"] == 0 and after["pagedbench:kv_cache_used_blocks"] == 0
    assert d["pagedbench:generation_tokens_total"] == 150 and d["pagedbench:prompt_tokens_total"] == 3
    assert d["pagedbench:request_success_total{finished_reason=length}"] == 1
    assert d["pagedbench:time_to_first_token_seconds_count"] == 1
    assert d["pagedbench:e2e_request_latency_seconds_count"] == 1
    assert d["pagedbench:inter_token_latency_seconds_count"] == 149
    assert d["pagedbench:prefix_cache_queries_total"] >= 3 and d["pagedbench:engine_step_seconds_count"] >= 150


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "tiny", "--port", "0"], "error: --port must be in 1..65535; got 0"),
    (["--model", "tiny", "--num-blocks", "0"], "error: --num-blocks must be >= 1; got 0"),
    (["--model", "nope"], "error: --model 'nope': no such model folder"),
])
def test_serve_arguments_are_checked_before_loading(argv, message, capsys):
    from pagedbench.refengine.cli import main

    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err.startswith(message)


def test_a_stopped_engine_answers_503():
    running = start_in_thread(LLM(resolve_model("tiny"), num_blocks=8, seed=0), model_name="tiny")
    try:
        with httpx.Client(base_url=running.url, timeout=TIMEOUT) as c:
            running.engine.shutdown()
            health = c.get("/health")
            r = c.post("/v1/completions", json=completion([1, 2], 2))
    finally:
        running.stop()
    assert health.status_code == 503 and "the engine is not running" in health.json()["error"]["message"]
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_penalties_reach_the_sampler(client):
    prompt = [5, 6, 7, 5, 6, 7]
    params = dict(repetition_penalty=10.0, presence_penalty=2.0, frequency_penalty=2.0)
    got = client.post("/v1/completions", json=completion(prompt, 48, **params))
    assert got.status_code == 200, got.text
    llm = LLM(resolve_model("tiny"), **ENGINE)
    want = llm.generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True, **params))[0].outputs[0].token_ids
    plain = client.post("/v1/completions", json=completion(prompt, 48)).json()["choices"][0]["token_ids"]
    assert got.json()["choices"][0]["token_ids"] == want != plain
    bad = client.post("/v1/completions", json=completion(prompt, 4, presence_penalty=3.0))
    assert bad.status_code == 400 and "presence_penalty" in bad.json()["error"]["message"]
