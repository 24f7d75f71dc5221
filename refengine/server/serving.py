"""Serving one API call on the online engine: add its requests (one per prompt), follow their streams
into a response or an SSE stream, and abort them when the client leaves.

A whole response waits on the requests and on a disconnect listener at once (as vLLM does): a client
that leaves aborts its requests, freeing their KV blocks before the next step. A stream aborts at its
next write. A batch of prompts streams its requests' chunks as each moves.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pagedbench.refengine.engine.async_llm import AsyncLLM, EngineDeadError
from pagedbench.refengine.engine.sampling_params import SamplingParams
from pagedbench.refengine.errors import InvalidRequestError
from pagedbench.refengine.server.metrics import ServerMetrics
from pagedbench.refengine.server.responses import (
    SSE_DONE,
    ResponseBuilder,
    batch_response,
    batch_usage,
    sse_error,
)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass(frozen=True)
class Call:
    """One prompt of an API call: what the engine takes, and what the response puts before its text."""

    prompt: dict
    params: SamplingParams
    echo: str = ""


class Server:
    """What the routes share: the engine, the metrics, the model's name and tokenizer."""

    def __init__(self, engine: AsyncLLM, metrics: ServerMetrics, model_name: str) -> None:
        self.engine, self.metrics, self.model_name = engine, metrics, model_name
        self.tokenizer = engine.llm.tokenizer

    async def serve(self, calls: list[Call], *, stream: bool, include_usage: bool, request: Request,
                    chat: bool):
        builders: list[ResponseBuilder] = []
        try:
            for p, call in enumerate(calls):
                builders.append(self._builder(await self._add(call, chat), call, chat, p, builders))
        except BaseException:
            for b in builders:  # a later prompt was refused: the batch is not served
                b.stream.close()
                self._observe(b)
            raise
        if stream:
            return StreamingResponse(self._sse(builders, include_usage), media_type="text/event-stream")
        collect = asyncio.ensure_future(asyncio.gather(*(self._collect(b) for b in builders)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left: stop waiting and free its blocks
                collect.cancel()
                for b in builders:
                    b.stream.close()
                    self._observe(b)
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)
        collect.result()
        error = next((b.error for b in builders if b.error is not None), None)
        if error is not None:
            raise APIError(500, error, "server_error")
        return builders[0].response() if len(builders) == 1 else batch_response(builders)

    async def _add(self, call: Call, chat: bool):
        try:
            return await self.engine.add(call.prompt, call.params)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="messages" if chat else "prompt") from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "server_error") from None

    def _builder(self, stream, call: Call, chat: bool, p: int, earlier: list[ResponseBuilder]) -> ResponseBuilder:
        stops = call.params.stop
        return ResponseBuilder(stream, model_name=self.model_name, tokenizer=self.tokenizer, chat=chat,
                               hold=max(map(len, stops)) - 1 if stops else 0, echo=call.echo,
                               logprobs=call.params.logprobs, first_index=p * call.params.n,
                               request_id=earlier[0].id if earlier else None)

    async def _collect(self, builder: ResponseBuilder) -> None:
        try:
            async for update in builder.stream:
                builder.apply(update)
        finally:
            if builder.stream.finished:
                self._observe(builder)

    async def _sse(self, builders: list[ResponseBuilder], include_usage: bool):
        try:
            async for builder, update in _merged(builders):
                for chunk in builder.sse_chunks(update):
                    yield chunk
            error = next((b.error for b in builders if b.error is not None), None)
            if error is not None:
                yield sse_error(error, 500)
            elif include_usage:
                yield builders[0].sse_usage(batch_usage(builders))
            yield SSE_DONE
        finally:
            for b in builders:
                b.stream.close()  # the client went away mid-stream: abort (a no-op once finished)
                self._observe(b)

    def _observe(self, builder: ResponseBuilder) -> None:
        if builder.observed:
            return
        builder.observed = True
        self.metrics.observe_request(builder.stream.arrival_time_s, builder.token_times_s,
                                     builder.num_output_tokens, builder.finished_reason)


async def _merged(builders: list[ResponseBuilder]):
    """``(builder, update)`` from every builder's stream as each arrives, until all have ended."""
    if len(builders) == 1:  # the common case, without a task per update
        async for update in builders[0].stream:
            yield builders[0], update
        return
    pending = {asyncio.ensure_future(b.stream.__anext__()): b for b in builders}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                builder = pending.pop(task)
                try:
                    update = task.result()
                except StopAsyncIteration:
                    continue
                yield builder, update
                pending[asyncio.ensure_future(builder.stream.__anext__())] = builder
    finally:
        for task in pending:
            task.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (its body already read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
