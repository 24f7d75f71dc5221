"""What the study measures, engine-agnostic: runners, alternated best-of-N timing, ratio and greedy equality.

A *runner* is one engine behind three calls (:class:`Runner`): ``start()`` (load, allocate the KV cache,
compile, serve one 1-token request), ``run(prompts, max_tokens)`` (one timed batch, greedy, ``ignore_eos``)
and ``close()``. A runner that cannot start here raises :class:`NotRunnable` with the reason, and its row
says so; one that fails later keeps its row with the error. Nothing here imports torch or vLLM, so the
logic is tested on stand-in runners.

Time to first output is defined as engine construction (weights, KV allocation, warm-up or compilation)
plus the wall time of the first request served after it: one prompt, one token. It is what a user waits
from "start the engine" to a first answer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class NotRunnable(Exception):
    """The engine cannot run here (not installed, no model...): the message is the row's reason."""


@dataclass(frozen=True, slots=True)
class Startup:
    startup_s: float  # constructor wall time: weights, KV allocation, warm-up or compilation
    first_request_s: float  # the first request after it: one prompt, one token
    versions: dict  # torch, vllm... of the process the engine runs in
    settings: dict  # what the engine was configured with (threads, KV bytes, block size, ...)

    @property
    def first_output_s(self) -> float:
        return self.startup_s + self.first_request_s


@dataclass(frozen=True, slots=True)
class Run:
    wall_s: float  # one batch, from submitting every prompt to the last finished request
    token_ids: tuple[tuple[int, ...], ...]  # generated tokens, one tuple per request, in prompt order

    @property
    def generated_tokens(self) -> int:
        return sum(map(len, self.token_ids))

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s


class Runner(Protocol):
    name: str

    def start(self) -> Startup: ...

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Run: ...

    def close(self) -> None: ...


def best_of(runs: Sequence[Run]) -> Run:
    """The fastest run (least wall time): on a shared machine, the run least disturbed by others."""
    if not runs:
        raise ValueError("best_of needs at least one run, got none")
    return min(runs, key=lambda r: r.wall_s)


def ratio(ours: Run, theirs: Run) -> float:
    """Our tokens/s over theirs (above 1: ours is faster)."""
    return ours.tokens_per_s / theirs.tokens_per_s


@dataclass(frozen=True, slots=True)
class Equality:
    """Greedy outputs compared request by request, every token."""

    num_requests: int
    first_mismatch: tuple[int | None, ...]  # per request: the first position that differs, None if equal

    @property
    def num_equal(self) -> int:
        return sum(m is None for m in self.first_mismatch)

    @property
    def verdict(self) -> str:
        return "equal" if self.num_equal == self.num_requests else f"{self.num_equal}/{self.num_requests} equal"


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def equality(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> Equality:
    if len(ours) != len(theirs):
        raise ValueError(f"equality needs the same requests on both sides, got {len(ours)} and {len(theirs)}")
    return Equality(len(ours), tuple(_first_mismatch(a, b) for a, b in zip(ours, theirs)))


@dataclass(slots=True)
class EngineRow:
    """One engine's session: how it started, every timed run, or why it did not run (mutable while it runs)."""

    name: str
    status: str = "ok"  # "ok", "not run" (could not start here) or "error" (failed after starting)
    reason: str | None = None  # why not "ok"
    startup: Startup | None = None
    runs: list[Run] = field(default_factory=list)
    load_1min: list[float] = field(default_factory=list)  # the 1-minute load average as each run began

    @property
    def best(self) -> Run | None:
        return best_of(self.runs) if self.runs else None


def _start_all(runners: Sequence[Runner], log: Callable[[str], None]) -> tuple[list[EngineRow], list[Runner]]:
    rows, live = [], []
    for runner in runners:  # one at a time: starting engines must not slow each other's start down
        row = EngineRow(runner.name)
        rows.append(row)
        log(f"starting {runner.name}")
        try:
            row.startup = runner.start()
        except NotRunnable as exc:
            row.status, row.reason = "not run", str(exc)
            continue
        except Exception as exc:  # a broken install or a crash: the other engines still run
            row.status, row.reason = "error", f"start failed: {type(exc).__name__}: {exc}"
            runner.close()
            continue
        live.append(runner)
    return rows, live


def run_session(runners: Sequence[Runner], prompts: Sequence[Sequence[int]], max_tokens: int, repetitions: int,
                *, settle_s: float = 0.0, log: Callable[[str], None] = lambda _: None) -> list[EngineRow]:
    """Start every runner, then alternate them (A B C A B C...) ``repetitions`` times over the same batch.

    Alternating means a burst of load from other jobs on a shared machine hits every engine alike; the
    best run of each counts. ``settle_s``: a pause before each run, so that one engine's spinning
    OpenMP threads (they wait a while for more work) do not steal the next engine's cores.
    Every runner is closed on return.
    """
    if repetitions < 1:
        raise ValueError(f"repetitions must be at least 1, got {repetitions}")
    rows, live = _start_all(runners, log)
    by_name = {row.name: row for row in rows}
    try:
        for rep in range(repetitions):
            for runner in list(live):
                time.sleep(settle_s)
                log(f"run {rep + 1}/{repetitions}: {runner.name}")
                by_name[runner.name].load_1min.append(os.getloadavg()[0])
                try:
                    by_name[runner.name].runs.append(runner.run(prompts, max_tokens))
                except Exception as exc:
                    row = by_name[runner.name]
                    row.status, row.reason = "error", f"run {rep + 1} failed: {type(exc).__name__}: {exc}"
                    live.remove(runner)
                    runner.close()
    finally:
        for runner in live:
            runner.close()
    return rows


def comparisons(rows: Sequence[EngineRow], reference: str) -> list[dict]:
    """The reference engine against every other engine that ran: ratio of best tokens/s and equality."""
    ref = next((r for r in rows if r.name == reference), None)
    if ref is None:
        raise ValueError(f"no engine named {reference!r} among {[r.name for r in rows]}")
    out = []
    for row in rows:
        if row is ref:
            continue
        if ref.best is None or row.best is None:
            missing = ref if ref.best is None else row
            out.append({"ours": ref.name, "theirs": row.name, "status": "not compared",
                        "reason": f"{missing.name} has no run ({missing.status}: {missing.reason})"})
            continue
        eq = equality(ref.best.token_ids, row.best.token_ids)
        out.append({"ours": ref.name, "theirs": row.name, "status": "ok",
                    "ratio": ratio(ref.best, row.best),
                    # seconds, ours over theirs: below 1, ours answers sooner after being started
                    "first_output_ratio": (ref.startup.first_output_s / row.startup.first_output_s
                                           if ref.startup and row.startup else None),
                    "equality": {"verdict": eq.verdict, "num_equal": eq.num_equal,
                                 "num_requests": eq.num_requests, "first_mismatch": list(eq.first_mismatch)}})
    return out
