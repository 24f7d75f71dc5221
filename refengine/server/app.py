"""The OpenAI-compatible HTTP front: FastAPI routes that translate HTTP to the online engine's ``add``,
``abort`` and token stream, and decide nothing (who runs, when, where its KV lives: the engine's loop).

==========================  ======  ==============================================================
``/v1/completions``         POST    a prompt (text or token ids); SSE with ``"stream": true``
``/v1/chat/completions``    POST    messages rendered with the model folder's chat template
``/v1/models``              GET     the served model
``/v1/models/{id}``         GET     the served model by name (404 for any other)
``/tokenize``               POST    a prompt or chat messages to token ids (vLLM's shapes)
``/detokenize``             POST    token ids to text
``/health``                 GET     200 while the engine thread runs, else 503
``/metrics``                GET     Prometheus text (``server/metrics.py``)
==========================  ======  ==============================================================

Errors have OpenAI's body (``{"error": {"message", "type", "param", "code"}}``): 422 for a body that
is not the API's shape, 400 for one the engine refuses (a text prompt without a tokenizer, a prompt
too long, a request that could never fit the KV pool, an unsupported field), 404 for an unknown
model or path, 503 once the engine has stopped. A client that disconnects aborts its request (a
stream at its next write; a whole response through a disconnect listener, as vLLM does), freeing its
KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pagedbench.refengine.engine.async_llm import AsyncLLM, EngineDeadError
from pagedbench.refengine.errors import InvalidArgumentError, InvalidRequestError
from pagedbench.refengine.model.chat_template import ChatTemplateError, render_chat
from pagedbench.refengine.server.metrics import ServerMetrics
from pagedbench.refengine.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UnsupportedError,
    error_body,
    first_invalid_text,
    generation_defaults,
)
from pagedbench.refengine.server.responses import SSE_DONE, ResponseBuilder, sse_error
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # chat has no documented default: ours, capped by the model's length


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind=kind, param=param), status_code=status)


def build_app(engine: AsyncLLM, *, model_name: str, model_folder: str | None = None) -> FastAPI:
    """The app over a started ``engine``; ``model_folder``: the Hugging Face folder the model came from
    (its chat template serves ``/v1/chat/completions``), None for a random-weight config."""
    app = FastAPI(title="PagedBench reference engine", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(model_name)
    tokenizer = engine.llm.tokenizer
    sampling_defaults = generation_defaults(model_folder)
    created = int(time.time())
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return _error(422, f"invalid request body: {where or 'body'}: {first.get('msg', 'malformed')}",
                      param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):  # a bug of ours: still OpenAI's shape
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return _error(503, f"the engine is not running: {engine.dead_reason or 'stopped'}", "server_error")
        return Response(status_code=200)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "pagedbench",
            "max_model_len": engine.llm.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(model_id, model_name)
        return card

    def _need_tokenizer(what: str):
        if tokenizer is None:
            raise APIError(400, f"model {model_name!r} has no tokenizer: {what} needs a model folder with "
                                "tokenizer.json")
        return tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(body.model, model_name)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "tokenize takes exactly one of 'prompt' and 'messages'", param="prompt")
        _check_text(body, "messages" if body.prompt is None else "prompt")
        tok = _need_tokenizer("/tokenize")
        if body.prompt is not None:
            ids = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids)
        else:
            if model_folder is None:
                raise APIError(400, f"model {model_name!r} has no chat template", param="messages")
            try:
                ids = render_chat(model_folder, tok, body.message_dicts())["prompt_token_ids"]
            except (ChatTemplateError, UnsupportedError) as e:
                raise APIError(400, str(e), param="messages") from None
        return {"count": len(ids), "max_model_len": engine.llm.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(body.model, model_name)
        tok = _need_tokenizer("/detokenize")
        vocab = engine.llm.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(await engine.snapshot()), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, model_name)
        _check_text(body, "prompt")
        try:
            prompt = body.engine_prompt()
        except UnsupportedError as e:
            raise APIError(400, str(e), param="prompt") from None
        if "prompt" in prompt and tokenizer is not None:  # counted here: the context bound needs its length
            prompt = {"prompt_token_ids": list(tokenizer.encode(prompt["prompt"]).ids)}
        params = _params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, prompt, "prompt")
        return await _serve(prompt, params, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        _check_model(body.model, model_name)
        if tokenizer is None or model_folder is None:
            raise APIError(400, f"model {model_name!r} has no tokenizer and no chat template: chat needs a "
                                "model folder; use /v1/completions with token-id prompts", param="messages")
        _check_text(body, "messages")
        try:
            prompt = render_chat(model_folder, tokenizer, body.message_dicts())
        except (ChatTemplateError, UnsupportedError) as e:
            raise APIError(400, str(e), param="messages") from None
        params = _params(body, CHAT_DEFAULT_MAX_TOKENS, prompt, "messages")
        return await _serve(prompt, params, body, request, chat=True)

    def _params(body, default_max_tokens: int, prompt: dict, what: str):
        """The request's SamplingParams, bounded by the context as vLLM does: an explicit ``max_tokens``
        that with the prompt passes ``max_model_len`` is refused; the default shrinks to what is left."""
        max_len = engine.llm.max_model_len
        num_prompt = len(prompt.get("prompt_token_ids", ()))
        asked = body.max_tokens if body.max_tokens is not None else getattr(body, "max_completion_tokens", None)
        if asked is not None and num_prompt and num_prompt + asked > max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you requested "
                                f"{num_prompt + asked} tokens ({num_prompt} in the {what}, {asked} in the "
                                "completion). Please reduce the length of the prompt or completion.",
                           param="max_tokens")
        default = max(1, min(default_max_tokens, max_len - num_prompt))
        try:
            return body.sampling_params(default, sampling_defaults)
        except (UnsupportedError, InvalidArgumentError) as e:
            raise APIError(400, str(e)) from None

    async def _serve(prompt, params, body, request: Request, *, chat: bool):
        try:
            stream = await engine.add(prompt, params)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error") from None
        builder = ResponseBuilder(stream, model_name=model_name, tokenizer=tokenizer, chat=chat)
        if body.stream:
            return StreamingResponse(_sse(stream, builder, body.include_usage), media_type="text/event-stream")
        collect = asyncio.ensure_future(_collect(stream, builder))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left: stop waiting and free its blocks
                collect.cancel()
                stream.close()
                _observe(stream, builder)
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)
        collect.result()
        if builder.error is not None:
            raise APIError(500, builder.error, "server_error")
        return builder.response()

    async def _collect(stream, builder: ResponseBuilder) -> None:
        try:
            async for update in stream:
                builder.apply(update)
        finally:
            if stream.finished:
                _observe(stream, builder)

    async def _sse(stream, builder: ResponseBuilder, include_usage: bool):
        try:
            async for update in stream:
                for chunk in builder.sse_chunks(update):
                    yield chunk
            if builder.error is not None:
                yield sse_error(builder.error, 500)
            elif include_usage:
                yield builder.sse_usage()
            yield SSE_DONE
        finally:
            stream.close()  # the client went away mid-stream: abort (a no-op once finished)
            _observe(stream, builder)

    def _observe(stream, builder: ResponseBuilder) -> None:
        if builder.observed:
            return
        builder.observed = True
        metrics.observe_request(stream.arrival_time_s, builder.token_times_s, builder.num_output_tokens,
                                builder.finished_reason)

    return app


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}",
                       "not_found_error", "model")


def _check_text(body, field: str) -> None:
    where = first_invalid_text(body.model_dump(), "")
    if where is not None:
        raise APIError(400, f"{where}: not valid Unicode (a lone surrogate?): every string must encode as UTF-8",
                       param=field)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (its body already read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
