"""A load generator for any OpenAI-compatible endpoint: replays a trace or workload in real time.

``python -m pagedbench.bench loadgen --url http://127.0.0.1:8000 --trace azure-conv [--requests N]
[--arrivals trace|poisson|gamma|constant --rate R | --arrivals none] [--max-concurrency C] [--time-scale S]
[--vocab-size V] [--out FILE.json]``

The trace is read by :func:`pagedbench.bench.workloads.trace_formats.load_trace` (any format it reads, or a shipped
trace by name); its arrival times are its own (``--time-scale`` stretches or compresses them) or drawn
by :mod:`pagedbench.bench.workloads.arrivals`. Each request is sent at its arrival time as a streaming
``POST /v1/completions`` whose prompt is token ids (:func:`trace_formats.prompt_token_ids`, so a
trace's shared prefixes stay shared; ``--vocab-size`` folds them into a small model's vocabulary) and
whose ``max_tokens`` is the trace's output length, held to it by ``ignore_eos`` (vLLM's extra
parameter, the default), ``min_tokens`` (ours and vLLM's), or nothing (``--length-control none``).

Only the HTTP API is used, so the same command drives vLLM or SGLang. Per request it records when it
was sent and when each streamed token arrived (a chunk's time for each token it carries: the
``token_ids`` field when the server sends one, else one token per non-empty chunk), and derives the
serving study's metrics with its definitions and key names (:mod:`pagedbench.bench.common.serving_metrics`:
TTFT, TPOT without the first token, ITL, E2E; the send time is the arrival). Queueing delay is not
observable from a client: its keys are left out. A request that gets an HTTP error, a broken stream or
a time-out is *failed*: counted and listed apart, never in the latencies. Offered rate (the schedule's
requests per second) is reported beside the achieved one (completed requests over the run).

``--max-concurrency C`` keeps at most C requests in flight, as ``vllm bench serve --max-concurrency``: a
request waits for its arrival *and* a free slot, and its latencies count from when it was sent.
``--arrivals none`` schedules every request at 0, so with ``--max-concurrency`` the load is a closed loop
(aiperf's and GuideLLM's concurrency mode): a new request the moment one ends, C always in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records
from pagedbench.bench.common.serving_metrics import RequestTiming, request_metrics, summarize
from pagedbench.bench.workloads import Request, arrivals, trace_formats

LENGTH_CONTROLS = ("ignore_eos", "min_tokens", "none")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the client saw it (times in seconds from the run's start)."""

    request_id: int
    scheduled_s: float  # its arrival time in the schedule
    sent_s: float  # when it was sent (>= scheduled_s; the lag is the generator's own delay)
    prompt_len: int
    requested_output_len: int
    token_times_s: tuple[float, ...]  # one per output token received
    error: str | None  # None: completed

    @property
    def completed(self) -> bool:
        return self.error is None and len(self.token_times_s) > 0


@dataclass(frozen=True, slots=True)
class LoadResult:
    records: tuple[RequestRecord, ...]
    duration_s: float  # first send to last response end

    @property
    def failed(self) -> tuple[RequestRecord, ...]:
        return tuple(r for r in self.records if not r.completed)

    def summary(self) -> dict:
        """The serving study's summary over the completed requests, with the failures and rates."""
        done = [r for r in self.records if r.completed]
        metrics = [request_metrics(RequestTiming(r.request_id, r.sent_s, r.prompt_len, len(r.token_times_s),
                                                 r.sent_s, r.token_times_s)) for r in done]
        doc = summarize(metrics, self.duration_s) if self.duration_s > 0 else {"completed": 0}
        doc = {k: v for k, v in doc.items() if "_queue_" not in k}  # not observable by a client
        scheduled = sorted(r.scheduled_s for r in self.records)
        span = scheduled[-1] - scheduled[0] if scheduled else 0.0
        doc.update(num_requests=len(self.records), failed=len(self.records) - len(done),
                   offered_request_rate=(len(scheduled) - 1) / span if span > 0 else None,
                   achieved_request_rate=len(done) / self.duration_s if self.duration_s > 0 else 0.0,
                   max_send_lag_ms=max((r.sent_s - r.scheduled_s for r in self.records), default=0.0) * 1e3,
                   num_short_outputs=sum(len(r.token_times_s) < r.requested_output_len for r in done))
        return doc


def request_body(r: Request, *, model: str | None, vocab_size: int | None, length_control: str) -> dict:
    """The streaming completion request for trace request ``r``."""
    ids = trace_formats.prompt_token_ids(r)
    if vocab_size is not None:
        ids = [t % vocab_size for t in ids]
    body: dict = {"prompt": ids, "max_tokens": r.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if length_control == "ignore_eos":
        body["ignore_eos"] = True
    elif length_control == "min_tokens":
        body["min_tokens"] = r.output_len
    return body


async def _one(client, url: str, r: Request, body: dict, start: float, timeout_s: float,
               slots: asyncio.Semaphore | None = None, until: float | None = None) -> RequestRecord | None:
    """``r``'s record, or None when the run's duration ended before it could be sent."""
    delay = start + r.arrival_s - time.perf_counter()
    if until is not None and start + r.arrival_s > until:
        return None
    if delay > 0:
        await asyncio.sleep(delay)
    if slots is None:
        return await _send(client, url, r, body, start, timeout_s)
    async with slots:
        if until is not None and time.perf_counter() > until:  # its slot came after the run's end
            return None
        return await _send(client, url, r, body, start, timeout_s)


async def _send(client, url: str, r: Request, body: dict, start: float, timeout_s: float) -> RequestRecord:
    sent = time.perf_counter()
    times: list[float] = []
    error = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                error = f"HTTP {resp.status_code}: {text[:300]}"
            else:
                done = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = f"stream error: {chunk['error'].get('message')}"
                        break
                    for choice in chunk.get("choices", ()):
                        ids = choice.get("token_ids")
                        n = len(ids) if ids is not None else int(bool(choice.get("text")))
                        times.extend([now] * n)
                if error is None and not done:
                    error = "the stream ended without [DONE]"
    except Exception as exc:  # connection refused, reset, time-out, bad JSON: a failed request
        error = f"{type(exc).__name__}: {exc}"
    if error is None and not times:
        error = "no tokens received"
    return RequestRecord(r.request_id, r.arrival_s, sent - start, r.prompt_len, r.output_len,
                         tuple(t - start for t in times), error)


async def run_load(base_url: str, requests: Sequence[Request], *, model: str | None = None,
                   vocab_size: int | None = None, length_control: str = "ignore_eos",
                   timeout_s: float = 600.0, max_concurrency: int | None = None,
                   duration_s: float | None = None) -> LoadResult:
    """Send every request at its ``arrival_s`` (seconds from now), with at most ``max_concurrency`` in
    flight (None: no bound), and wait for all of them; with ``duration_s``, none is sent after that many
    seconds (those not sent are left out, not failed)."""
    if duration_s is not None and not (isinstance(duration_s, (int, float)) and duration_s > 0):
        raise ValueError(f"duration_s must be None or a number > 0, got {duration_s!r}")
    import httpx

    if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                        or max_concurrency < 1):
        raise ValueError(f"max_concurrency must be None or an int >= 1, got {max_concurrency!r}")
    if length_control not in LENGTH_CONTROLS:
        raise ValueError(f"length_control must be one of {', '.join(LENGTH_CONTROLS)}, got {length_control!r}")
    if not requests:
        raise ValueError("no requests to send")
    url = base_url.rstrip("/") + "/v1/completions"
    bodies = [request_body(r, model=model, vocab_size=vocab_size, length_control=length_control) for r in requests]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency is not None else None
        start = time.perf_counter()
        until = None if duration_s is None else start + duration_s
        sent = await asyncio.gather(*(_one(client, url, r, b, start, timeout_s, slots, until)
                                      for r, b in zip(requests, bodies)))
        recs = [r for r in sent if r is not None]
        end = time.perf_counter() - start
    first = min((r.sent_s for r in recs), default=0.0)
    return LoadResult(tuple(recs), end - first)


def schedule(trace: Sequence[Request], *, pattern: str, rate: float | None, time_scale: float,
             burstiness: float, seed: int) -> tuple[Request, ...]:
    """``trace`` with its arrival times: its own (scaled) for ``pattern == "trace"``, else drawn; the
    first request is sent at 0."""
    if pattern == "trace":
        out = arrivals.replay(tuple(trace), time_scale)
    elif pattern == "none":  # every request at once: a closed loop under --max-concurrency
        out = arrivals.with_arrivals(tuple(trace), [0.0] * len(trace))
    else:
        if rate is None:
            raise ValueError(f"--arrivals {pattern} needs --rate")
        out = arrivals.with_arrivals(tuple(trace), arrivals.arrival_times(
            pattern, len(trace), rate, burstiness=burstiness, seed=seed))
    t0 = min(r.arrival_s for r in out)
    return arrivals.with_arrivals(out, [r.arrival_s - t0 for r in out])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedbench.bench loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", required=True, help="a trace file, or a shipped trace's name "
                   f"({', '.join(trace_formats.SHIPPED)})")
    p.add_argument("--format", choices=trace_formats.FORMATS, help="the trace's format (default: sniffed)")
    p.add_argument("--requests", type=int, help="send the first N requests only")
    p.add_argument("--max-seq-len", type=int, help="the model's context: longer requests follow --over-context")
    p.add_argument("--over-context", default="error", choices=trace_formats.OVER_CONTEXT)
    p.add_argument("--arrivals", default="trace", choices=("trace", "none", *arrivals.PATTERNS),
                   help="the trace's own times, none (every request at 0: a closed loop with --max-concurrency), "
                        "or drawn at --rate")
    p.add_argument("--max-concurrency", type=_concurrency_list,
                   help="at most this many requests in flight (default: no bound); a list (1,2,4,8) runs the load "
                        "once per value, a sweep")
    p.add_argument("--duration", type=float, help="send no request after this many seconds (per run)")
    p.add_argument("--rate", type=float, help="requests/s for drawn arrivals")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies the trace's own times (default 1)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals' shape (1 = Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="the model name to send (default: none; a server serving one model accepts it)")
    p.add_argument("--vocab-size", type=int, help="fold prompt token ids into [0, V) (a small model's vocabulary)")
    p.add_argument("--length-control", default="ignore_eos", choices=LENGTH_CONTROLS)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request time-out in seconds")
    p.add_argument("--out", help="write the records and summary as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.duration is not None and not args.duration > 0:
        parser.error(f"--duration must be > 0, got {args.duration}")
    path = trace_formats.SHIPPED.get(args.trace, args.trace)
    loaded = trace_formats.load_trace(path, format=args.format, max_seq_len=args.max_seq_len,
                                      over_context=args.over_context)
    trace = loaded.requests[:args.requests] if args.requests else loaded.requests
    reqs = schedule(trace, pattern=args.arrivals, rate=args.rate, time_scale=args.time_scale,
                    burstiness=args.burstiness, seed=args.seed)
    runs = []
    for c in args.max_concurrency or [None]:
        result = asyncio.run(run_load(args.url, reqs, model=args.model, vocab_size=args.vocab_size,
                                      length_control=args.length_control, timeout_s=args.timeout,
                                      max_concurrency=c, duration_s=args.duration))
        summary = {"max_concurrency": c, **result.summary()}
        print(("" if c is None else f"max concurrency {c}: ") + format_summary(summary))
        for r in result.failed[:10]:
            print(f"  failed request {r.request_id}: {r.error}")
        runs.append((summary, result))
    if args.out:
        doc = {"schema_version": records.SCHEMA_VERSION, "environment": env_mod.environment(),
               "config": {**vars(args), "trace_path": loaded.path, "trace_format": loaded.format},
               # one run: its summary and requests at the top, as before; a sweep: one entry per value too
               "summary": runs[0][0], "requests": [asdict(r) for r in runs[0][1].records],
               "sweep": [{"summary": s, "requests": [asdict(r) for r in res.records]} for s, res in runs]}
        records.write_json(Path(args.out), doc)
    return 1 if any(res.failed for _, res in runs) else 0


def _concurrency_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a concurrency or a comma-separated list of them, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every concurrency must be >= 1, got {text!r}")
    return values


def format_summary(s: dict) -> str:
    def ms(key: str) -> str:
        v = s.get(key)
        return "-" if v is None else f"{v:.1f}"

    offered = s["offered_request_rate"]
    return (f"{s['completed']} completed, {s['failed']} failed of {s['num_requests']} in {s.get('duration', 0):.2f} s; "
            f"offered {'-' if offered is None else f'{offered:.2f}'} req/s, achieved "
            f"{s['achieved_request_rate']:.2f} req/s\n"
            f"TTFT ms mean/p50/p99 {ms('mean_ttft_ms')}/{ms('median_ttft_ms')}/{ms('p99_ttft_ms')}; "
            f"TPOT {ms('mean_tpot_ms')}/{ms('median_tpot_ms')}/{ms('p99_tpot_ms')}; "
            f"ITL {ms('mean_itl_ms')}/{ms('median_itl_ms')}/{ms('p99_itl_ms')}; "
            f"E2E {ms('mean_e2el_ms')}/{ms('median_e2el_ms')}/{ms('p99_e2el_ms')}")
