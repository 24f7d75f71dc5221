"""A real trace as the serving study's arrival stream: its lengths and its arrival pattern at any rate.

A point of the study serves the arrivals of a span at an offered rate. For a trace dataset those are the
trace's own requests (lengths, shared prefixes), replayed with their timestamps scaled so that the trace's
mean rate becomes the point's rate (:func:`pagedbench.bench.workloads.arrivals.replay`): bursts and lulls keep
their shape. Seed ``s`` starts the replay at a request drawn from the trace by ``s``, so seeds sample
different stretches of it; a span longer than the scaled trace wraps around to its first request (one
mean gap after its last), with request ids running on.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
from pathlib import Path

from pagedbench.bench.workloads import Request, arrivals, trace_formats


def trace_file(name: str) -> Path:
    """A shipped trace by name, else a path to a trace file."""
    return trace_formats.shipped(name) if name in trace_formats.SHIPPED else Path(name)


@functools.cache
def load(name: str, max_seq_len: int, over_context: str) -> trace_formats.LoadedTrace:
    """The trace's requests that fit ``max_seq_len`` by ``over_context`` (read once per process)."""
    return trace_formats.load_trace(trace_file(name), max_seq_len=max_seq_len, over_context=over_context)


@functools.cache
def sha256(name: str) -> str:
    """The trace file's content hash: a cached point follows the data, not the name."""
    return hashlib.sha256(trace_file(name).read_bytes()).hexdigest()


def mean_lengths(name: str, max_seq_len: int, over_context: str) -> tuple[float, float]:
    """(mean prompt tokens, mean output tokens) of the requests the study serves."""
    reqs = load(name, max_seq_len, over_context).requests
    return sum(r.prompt_len for r in reqs) / len(reqs), sum(r.output_len for r in reqs) / len(reqs)


def span(requests: tuple[Request, ...], rate: float, span_s: float, seed: int) -> tuple[Request, ...]:
    """The arrivals of ``[0, span_s)``: ``requests`` replayed at mean ``rate`` from a seed-drawn start
    (module docstring); at least one request, at time 0."""
    if not span_s > 0:
        raise ValueError(f"span_s must be > 0, got {span_s!r}")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    scaled = arrivals.replay(tuple(ordered), arrivals.time_scale_for_rate(tuple(ordered), rate))
    start = random.Random(seed).randrange(len(scaled))
    times = [r.arrival_s for r in scaled]
    period = times[-1] - times[0] + (times[-1] - times[0]) / max(len(times) - 1, 1)  # one mean gap to wrap
    out: list[Request] = []
    i, lap = start, 0
    while True:
        t = times[i] - times[start] + lap * period
        if t >= span_s and out:
            break
        out.append(dataclasses.replace(scaled[i], request_id=len(out), arrival_s=t))
        i += 1
        if i == len(scaled):
            i, lap = 0, lap + 1
    return tuple(out)
