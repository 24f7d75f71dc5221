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
model or path, 503 once the engine has stopped. Serving a call's requests and following their streams
is ``server/serving.py``.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pagedbench.refengine.engine.async_llm import AsyncLLM
from pagedbench.refengine.errors import InvalidArgumentError
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
from pagedbench.refengine.server.serving import APIError, Call, Server
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # chat has no documented default: ours, capped by the model's length


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
    server = Server(engine, metrics, model_name)

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
        calls = []
        for prompt in body.engine_prompts():
            echo = prompt.get("prompt", "") if body.echo else ""
            if "prompt" in prompt and tokenizer is not None:  # counted here: the context bound needs its length
                prompt = {"prompt_token_ids": list(tokenizer.encode(prompt["prompt"]).ids)}
            elif body.echo and tokenizer is not None:
                echo = tokenizer.decode(prompt["prompt_token_ids"])
            calls.append(Call(prompt, _params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, prompt, "prompt"), echo))
        return await server.serve(calls, stream=body.stream, include_usage=body.include_usage, request=request,
                                  chat=False)

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
        return await server.serve([Call(prompt, params)], stream=body.stream, include_usage=body.include_usage,
                                  request=request, chat=True)

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
