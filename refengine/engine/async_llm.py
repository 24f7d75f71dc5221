"""The online engine: :class:`AsyncLLM` adds requests while steps run and streams each one's tokens.

It is a thin front over one :class:`~pagedbench.refengine.engine.llm.LLM`: the same engine loop
(``LLM.step()``: plan, run, update), the same scheduler and executor. One *engine thread* owns the
``LLM`` and is the only code that touches it. Everything else talks to it through a command queue
(add, abort) and hears back through per-request asyncio queues::

    asyncio side (server)                         engine thread
    ---------------------                         -------------
    await engine.add(prompt, params) --cmd-->     llm.add_request(...)   (validates; error -> raise)
    async for update in stream:      <--post--    llm.step(); one StreamUpdate per request that moved
    stream.close() / disconnect      --cmd-->     llm.abort(request_id)  (blocks freed at once)

Between steps the thread drains the commands; with nothing to run it sleeps on the queue. After each
step it posts, per event loop, one batch of :class:`StreamUpdate` (one ``call_soon_threadsafe`` per
step, not one per request). A step that raises is rolled back by the engine; the requests it touched
are then aborted with ``error`` naming the failure (``LLM.generate``'s ``max_step_retries=0``), and the
server stays up.

Why a thread and not a process (vLLM runs its engine core in a separate process to escape the GIL):
on the CPU engine a step's time is the model's forward, whose matmuls, attention and softmax run in
torch's C++ kernels with the GIL released, so the asyncio side (HTTP parsing, JSON, SSE writes) runs
alongside them. What holds the GIL is the step's Python host work (scheduling, metadata, sampling
bookkeeping) and the server's own Python; a process would not remove that work, only move it, and it
would add a serialisation and a copy of every request and of every step's tokens through IPC, and a
second copy of the engine's API to keep in step. ``bench/server_overhead.py`` measures both costs of
this arrangement on SmolLM2 at batch 32 (``results/server_overhead.md``): the time a streamed token
spends outside the engine's step, and how much slower the step runs beside the HTTP side than alone.
Both are a few percent of the step there (the second is the GIL shared with the HTTP side), within
the 10% goal together. Revisit the choice if a faster model makes the step's Python share large:
the tiny model's 1 ms steps, almost all Python, do slow down several-fold beside a busy server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from dataclasses import dataclass

from pagedbench.refengine.engine.llm import LLM
from pagedbench.refengine.engine.request import Request
from pagedbench.refengine.engine.sampling_params import SamplingParams
from pagedbench.refengine.errors import InvalidArgumentError, InvalidRequestError, KVCacheError


class EngineDeadError(KVCacheError, RuntimeError):
    """The engine thread has stopped (shut down, or crashed on a broken invariant): no request can run."""


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """One completion's progress in one step."""

    index: int  # child index in [0, n)
    token_ids: tuple[int, ...]  # tokens generated since the last update
    num_output_tokens: int  # tokens generated so far, these included
    finish_reason: str | None  # set in the update where the completion ends
    # with SamplingParams(logprobs=k): one {token_id: logprob} per token of token_ids, else None
    logprobs: tuple[dict[int, float], ...] | None = None
    # the completion's whole text when a stop string ended it (cut there: engine/stop_strings.py), else None
    text: str | None = None


@dataclass(frozen=True, slots=True)
class StreamUpdate:
    """A request's progress after one step (or its end after an abort or a failed step)."""

    request_id: int
    deltas: tuple[TokenDelta, ...]  # the completions that moved
    time_s: float  # time.perf_counter() when the step producing them ended
    finished: bool  # every completion has ended: the last update of the stream
    error: str | None = None  # why the request was aborted by the engine (a failed step), else None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at the request's first admission


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state between two steps, for a metrics scrape."""

    num_running_requests: int
    num_waiting_requests: int
    num_used_blocks: int
    num_blocks: int
    block_size: int
    prefix_query_tokens: int  # cumulative
    prefix_hit_tokens: int  # cumulative, the device pool's cache
    num_preemptions: int  # cumulative
    num_prompt_tokens: int  # cumulative, requests accepted
    num_generated_tokens: int  # cumulative
    num_steps: int  # cumulative
    step_time_s: float  # cumulative wall time inside LLM.step
    prefix_host_hit_tokens: int = 0  # cumulative, loaded from the prefix cache's host tier
    prefix_computed_tokens: int = 0  # cumulative, looked up and served by neither tier


class _Tracked:
    """A request the engine thread streams: where to post and what was sent."""

    __slots__ = ("loop", "queue", "req", "sent")

    def __init__(self, req: Request, loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> None:
        self.req, self.loop, self.queue = req, loop, q
        self.sent = [0] * len(req.children)  # output tokens posted, per child


class RequestStream:
    """The updates of one request, as an async iterator; :meth:`close` aborts it if still running (a
    client that went away). Leaving an ``async for`` early does not abort by itself: call close."""

    def __init__(self, engine: AsyncLLM, req: Request, q: asyncio.Queue, arrival_time_s: float) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = req.prompt_token_ids
        self.num_completions = len(req.children)
        self.arrival_time_s = arrival_time_s  # time.perf_counter() when add was called
        self._engine, self._queue = engine, q
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamUpdate:
        if self.finished:
            raise StopAsyncIteration
        update = await self._queue.get()
        if update.finished:
            self.finished = True
        return update

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLM:
    """An :class:`LLM` served online (see the module docstring). Start with :meth:`start` (or as a
    context manager), add requests from coroutines with :meth:`add`, stop with :meth:`shutdown`."""

    def __init__(self, llm: LLM) -> None:
        if not isinstance(llm, LLM):
            raise InvalidArgumentError(f"AsyncLLM needs an LLM, got {type(llm).__name__}")
        self.llm = llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[int, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_reason: str | None = None
        self._step_time_s = 0.0

    # --- the asyncio side ---------------------------------------------------------------------------
    def start(self) -> AsyncLLM:
        if self._thread is not None:
            raise InvalidArgumentError("AsyncLLM already started")
        self._thread = threading.Thread(target=self._run, name="pagedbench-engine", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> AsyncLLM:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    async def add(self, prompt, params: SamplingParams | None = None) -> RequestStream:
        """Queue one prompt (token ids, text, or a prompt dict, as ``LLM.generate`` takes one); returns
        its stream. A request the engine rejects (empty, too long, can never fit the KV pool, text
        without a tokenizer...) raises :class:`InvalidRequestError` with the engine's reason."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason or 'not started'}")
        arrival = time.perf_counter()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", (prompt, params, loop, q, done)))
        req, rejected = await asyncio.wrap_future(done)
        if rejected is not None:
            raise InvalidRequestError(rejected)
        return RequestStream(self, req, q, arrival)

    async def snapshot(self) -> EngineSnapshot:
        """The engine's state between two steps (taken by the engine thread: a scrape waits for the step
        in flight, and costs nothing while nobody scrapes)."""
        if not self.is_running:
            return self._take_snapshot()  # no thread touches the engine any more
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("snapshot", done))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: int) -> None:
        """Abort a request (any thread, any time; an ended one is ignored): its blocks are freed before
        the next step and its stream ends with ``finish_reason="abort"``."""
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort every request, end their streams and stop the engine thread."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._commands.put(("stop", None))
        self._thread.join(timeout_s)

    # --- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        llm = self.llm
        try:
            while True:
                busy = llm.scheduler.has_unfinished()
                if not self._drain(block=not busy):
                    break
                if llm.scheduler.has_unfinished():
                    self._step()
        except BaseException as exc:  # a broken invariant: nothing can be trusted, fail every stream
            self.dead_reason = f"engine thread stopped: {type(exc).__name__}: {exc}"
            raise
        finally:
            self._stopping = True
            reason = self.dead_reason or "the server is shutting down"
            llm.abort_all()
            self._post([self._final(t, reason) for t in self._tracked.values()])
            self._tracked.clear()
            self._fail_pending_adds(reason)

    def _drain(self, *, block: bool) -> bool:
        """Run the queued commands (waiting for one when ``block``); False once told to stop."""
        while True:
            try:
                kind, arg = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if block and not self._stopping:
                    continue
                return not self._stopping
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*arg)
            elif kind == "snapshot":
                arg.set_result(self._take_snapshot())
            else:
                self._abort(arg)

    def _add(self, prompt, params, loop, q, done) -> None:
        try:
            req = self.llm.add_request(prompt, params)
        except Exception as exc:  # a bad SamplingParams type and the like: the caller's mistake
            done.set_exception(exc)
            return
        if req.error is None:
            self._tracked[req.request_id] = _Tracked(req, loop, q)
        # the rejection as it stands now: by the time the caller reads the result, later steps may have
        # run and failed this request (an error its stream reports, not a rejection)
        done.set_result((req, req.error))

    def _abort(self, request_id: int) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.llm.abort(request_id)
        self._post([self._final(tracked, None)])

    def _step(self) -> None:
        llm = self.llm
        start = time.perf_counter()
        try:
            llm.step()
        except Exception as exc:  # rolled back: abort what it touched, keep serving
            self._fail_step(exc)
        now = time.perf_counter()
        self._step_time_s += now - start
        updates, ended = [], []
        for rid, t in self._tracked.items():
            update = self._progress(t, now)
            if update is not None:
                updates.append((t, update))
                if update.finished:
                    ended.append(rid)
        for rid in ended:
            del self._tracked[rid]
        self._post(updates)

    def _fail_step(self, exc: Exception) -> None:
        core = self.llm.core
        touched = {s.request_id for s in core.rolled_back} or set(core.requests)
        why = f"a step failed: {type(exc).__name__}: {exc}"
        for rid in sorted(touched):
            req = core.requests.get(rid)
            if req is not None:
                req.error = why
                core.abort(rid)

    @staticmethod
    def _progress(t: _Tracked, now: float) -> StreamUpdate | None:
        deltas = []
        for i, s in enumerate(t.req.children):
            sent = t.sent[i]
            if sent < 0:  # its end was posted
                continue
            n = s.num_output_tokens
            if n > sent or s.finish_reason is not None:
                logprobs = tuple(s.logprobs[sent:n]) if s.logprobs is not None else None
                text = s.output_text if s.finish_reason is not None else None
                deltas.append(TokenDelta(s.child_index, tuple(s.token_ids[s.num_prompt_tokens + sent:]), n,
                                         s.finish_reason, logprobs, text))
                t.sent[i] = -1 if s.finish_reason is not None else n
        if not deltas:
            return None
        cached = t.req.children[0].num_cached_tokens if t.req.children else None
        return StreamUpdate(t.req.request_id, tuple(deltas), now, t.req.finished, t.req.error, cached or 0)

    @staticmethod
    def _final(t: _Tracked, error: str | None) -> tuple[_Tracked, StreamUpdate]:
        deltas = tuple(TokenDelta(s.child_index, (), s.num_output_tokens, s.finish_reason or "abort")
                       for i, s in enumerate(t.req.children) if t.sent[i] >= 0)
        return t, StreamUpdate(t.req.request_id, deltas, time.perf_counter(), True, error or t.req.error)

    def _post(self, updates: list[tuple[_Tracked, StreamUpdate]]) -> None:
        """One wake-up per event loop for all of a step's updates."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for t, u in updates:
            by_loop.setdefault(t.loop, []).append((t.queue, u))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: its clients are gone
                loop.call_soon_threadsafe(_deliver, items)

    def _fail_pending_adds(self, reason: str) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                arg[-1].set_exception(EngineDeadError(reason))
            elif kind == "snapshot":
                arg.set_result(self._take_snapshot())

    def _take_snapshot(self) -> EngineSnapshot:
        llm = self.llm
        sched = llm.scheduler
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        st = llm.stats
        return EngineSnapshot(
            num_running_requests=len(running), num_waiting_requests=len(waiting),
            num_used_blocks=st.num_used_blocks, num_blocks=st.num_blocks, block_size=st.block_size,
            prefix_query_tokens=st.prefix_query_tokens, prefix_hit_tokens=st.prefix_hit_tokens,
            num_preemptions=st.num_preemptions, num_prompt_tokens=st.num_prompt_tokens,
            num_generated_tokens=st.num_generated_tokens, num_steps=st.num_steps, step_time_s=self._step_time_s,
            prefix_host_hit_tokens=st.prefix_host_hit_tokens, prefix_computed_tokens=st.prefix_computed_tokens)


def _deliver(items) -> None:
    for q, update in items:
        q.put_nowait(update)
