"""Conversations and shared few-shot prefixes as request traces, with token ids that make shared prefixes share.

Prefix caching keys blocks on token ids, so a workload that is to share a prefix must give identical ids
where the text is identical and distinct ids elsewhere:

- **Sessions** (:func:`conversations`, :func:`multi_turn`, :func:`chatbot`): round ``k`` of a session is
  the session's history (every earlier user message and answer) plus a new user message, cut to its
  last ``max_history`` tokens (the vLLM paper's chatbot, Fig. 17, keeps the last 1024). Round 0 arrives
  at its time; round ``k > 0`` is a *follow-up* (``Request.release_after``): released ``think_s`` after
  round ``k - 1`` completes, so its arrival depends on the run (:mod:`pagedbench.bench.sim.run` releases
  it). User tokens are fresh ids, unique across every session and round; an answer's tokens are
  ``answer_token`` (default 0, the simulator's filler: what its executor generates), so the history a
  prompt repeats is exactly what the engine's KV holds.
- **Few-shot prefixes** (:func:`few_shot`): the vLLM paper's Fig. 16 translation workload, every prompt
  one shared few-shot prefix (one-shot 80 tokens, five-shot 341) and a short sentence of its own. The
  prefix ids are one seeded draw, the same for every request; each request's own ids are unique to it.

Two shapes of multi-turn benchmark: SGLang's (``benchmark/hicache/bench_multiturn.py``: clients x rounds,
a 512-token request and a 64-token answer each round, as we read its defaults; :data:`SGLANG_MULTITURN`),
and the paper's chatbot (ShareGPT-like messages and answers, history cut to 1024 tokens, answers up to
1024; :func:`chatbot`).

:data:`WORKLOADS` names the independent-arrival versions the serving points replay at a rate
(:class:`SpanWorkload`): ``fewshot-1``, ``fewshot-5`` and ``chatbot-1024`` (the paper's chatbot keeps no KV
between rounds, so its rounds arrive as independent Poisson requests).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from pagedbench.bench.workloads.datasets import DATASETS, Request, _calibrated_lognormal

#: the token the simulator's executor generates (``SimulatedExecutor.filler_token``)
FILLER_TOKEN = 0
#: the first id a user message or a request's own part takes (0 is the filler, 1 spare)
FIRST_FRESH_ID = 2
#: the vLLM paper's Fig. 16 prefixes: one translation example is 80 tokens, five are 341
FEW_SHOT_PREFIX_LEN = {1: 80, 5: 341}
#: LLaMA's vocabulary: a shared prefix's ids are drawn below it
PREFIX_VOCAB = 32_000
#: a request's own ids in a few-shot workload start here (above any prefix id), ``MAX_OWN_TOKENS`` per request
OWN_IDS_BASE = 1 << 20
MAX_OWN_TOKENS = 1 << 16
#: WMT16 English->German sentences in LLaMA tokens: ASSUMPTION (the paper gives no lengths): a mean of
#: about 30 source tokens and 35 target tokens, log-normal (German runs longer than English)
TRANSLATION_MEAN_SOURCE, TRANSLATION_MEAN_TARGET, TRANSLATION_SIGMA = 30.0, 35.0, 0.5


@dataclass(frozen=True, slots=True)
class SessionTrace:
    """Sessions as requests: ``requests`` (round 0 arriving at its time, later rounds follow-ups) and, by
    request id, each prompt's token ids and the (session, round) it belongs to."""

    requests: tuple[Request, ...]
    token_ids: Mapping[int, tuple[int, ...]]
    turn: Mapping[int, tuple[int, int]]  # request id -> (session, round)

    def prompt_tokens(self, r: Request) -> list[int]:
        """The prompt ids of ``r`` (the simulator's ``prompt_tokens``)."""
        return list(self.token_ids[r.request_id])


def _check_lengths(name: str, lens: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    lens = np.asarray(lens)
    if lens.shape != shape or lens.dtype.kind not in "iu" or (lens < 1).any():
        raise ValueError(f"{name} must be ints >= 1 of shape {shape} (sessions x rounds), got {lens.dtype} "
                         f"{lens.shape}")
    return lens


def conversations(user_lens, answer_lens, first_arrivals, *, think_s: float = 0.0,
                  max_history: int | None = None, system_prompt_len: int = 0,
                  answer_token: int = FILLER_TOKEN) -> SessionTrace:
    """Sessions of given lengths (``user_lens``, ``answer_lens``: ``[sessions, rounds]`` ints >= 1;
    ``first_arrivals``: each session's round-0 arrival in seconds). Each prompt is the session's
    history plus its new message, cut to the last ``max_history`` tokens (None: never cut); every
    session starts with the same ``system_prompt_len`` system-prompt tokens. See the module docstring."""
    first = np.asarray(first_arrivals, dtype=np.float64)
    if first.ndim != 1 or not np.isfinite(first).all() or (first < 0).any():
        raise ValueError(f"first_arrivals must be one finite time >= 0 per session, got shape {first.shape}")
    sessions = len(first)
    user = np.asarray(user_lens)
    rounds = user.shape[1] if user.ndim == 2 else 0
    user = _check_lengths("user_lens", user, (sessions, rounds))
    answer = _check_lengths("answer_lens", answer_lens, (sessions, rounds))
    if not (isinstance(think_s, (int, float)) and math.isfinite(think_s) and think_s >= 0):
        raise ValueError(f"think_s must be a finite number of seconds >= 0, got {think_s!r}")
    if max_history is not None and (type(max_history) is not int or max_history < 1):
        raise ValueError(f"max_history must be an int >= 1 or None, got {max_history!r}")
    if type(system_prompt_len) is not int or system_prompt_len < 0:
        raise ValueError(f"system_prompt_len must be an int >= 0, got {system_prompt_len!r}")
    fresh = FIRST_FRESH_ID
    system = list(range(fresh, fresh + system_prompt_len))
    fresh += system_prompt_len
    requests, token_ids, turn = [], {}, {}
    histories = [list(system) for _ in range(sessions)]
    for k in range(rounds):
        for s in range(sessions):
            rid = k * sessions + s
            n = int(user[s, k])
            prompt = histories[s] + list(range(fresh, fresh + n))
            fresh += n
            out = int(answer[s, k])
            histories[s] = prompt + [answer_token] * out
            if max_history is not None:
                prompt = prompt[-max_history:]
            after = None if k == 0 else rid - sessions
            requests.append(Request(rid, len(prompt), out, float(first[s]) if k == 0 else 0.0,
                                    release_after=after, think_s=float(think_s) if k else 0.0))
            token_ids[rid] = tuple(prompt)
            turn[rid] = (s, k)
    return SessionTrace(tuple(requests), token_ids, turn)


@dataclass(frozen=True, slots=True)
class MultiTurnShape:
    """A clients x rounds benchmark: each round a user message and an answer drawn uniformly from their
    inclusive ranges."""

    num_clients: int
    num_rounds: int
    user_len: tuple[int, int]
    answer_len: tuple[int, int]
    think_s: float = 0.0
    max_history: int | None = None
    system_prompt_len: int = 0


#: SGLang's multi-turn benchmark (benchmark/hicache/bench_multiturn.py, as we read its defaults: 256
#: clients, 5 rounds, 512-token requests, 64-token answers)
SGLANG_MULTITURN = MultiTurnShape(256, 5, (512, 512), (64, 64))


def multi_turn(shape: MultiTurnShape, *, rate: float | None = None, seed: int = 0) -> SessionTrace:
    """``shape``'s sessions, their first rounds arriving Poisson at ``rate`` sessions/s (None: all at 0)."""
    rng = np.random.default_rng(seed)
    size = (shape.num_clients, shape.num_rounds)
    lo_u, hi_u = shape.user_len
    lo_a, hi_a = shape.answer_len
    if not (1 <= lo_u <= hi_u and 1 <= lo_a <= hi_a):
        raise ValueError(f"length ranges must be 1 <= low <= high, got user {shape.user_len}, answer "
                         f"{shape.answer_len}")
    user = rng.integers(lo_u, hi_u + 1, size)
    answer = rng.integers(lo_a, hi_a + 1, size)
    first = np.zeros(shape.num_clients) if rate is None else np.cumsum(rng.exponential(1.0 / rate, shape.num_clients))
    return conversations(user, answer, first, think_s=shape.think_s, max_history=shape.max_history,
                         system_prompt_len=shape.system_prompt_len)


def chatbot(num_sessions: int, num_rounds: int, *, rate: float | None = None, think_s: float = 0.0,
            max_history: int = 1024, max_answer: int = 1024, seed: int = 0) -> SessionTrace:
    """The paper's chatbot (Fig. 17): ShareGPT-like messages (its prompt lengths) and answers (its output
    lengths, at most ``max_answer``), each prompt cut to the last ``max_history`` tokens."""
    stats = DATASETS["sharegpt"]
    rng = np.random.default_rng(seed)
    n = num_sessions * num_rounds
    calib = max(n, 20_000)  # (calibrated on a large sample, as workloads.synthetic does)
    user = _calibrated_lognormal(rng, calib, stats.mean_prompt, stats.sigma_prompt, max_history)[:n]
    answer = _calibrated_lognormal(rng, calib, stats.mean_output, stats.sigma_output, max_answer)[:n]
    first = np.zeros(num_sessions) if rate is None else np.cumsum(rng.exponential(1.0 / rate, num_sessions))
    return conversations(user.reshape(num_sessions, num_rounds), answer.reshape(num_sessions, num_rounds), first,
                         think_s=think_s, max_history=max_history)


def shared_prefix_ids(length: int, seed: int = 0) -> tuple[int, ...]:
    """A few-shot prefix's ``length`` token ids: one seeded draw below :data:`PREFIX_VOCAB`."""
    if type(length) is not int or length < 0:
        raise ValueError(f"a prefix length must be an int >= 0, got {length!r}")
    rng = np.random.default_rng([seed, length])
    return tuple(int(t) for t in rng.integers(FIRST_FRESH_ID, PREFIX_VOCAB, length))


def few_shot_tokens(prefix_len: int, seed: int = 0) -> Callable[[Request], list[int]]:
    """Prompt ids of a few-shot request: the shared prefix, then ids of its own (unique to its id)."""
    prefix = list(shared_prefix_ids(prefix_len, seed))

    def tokens(r: Request) -> list[int]:
        own = r.prompt_len - prefix_len
        if own < 1 or own > MAX_OWN_TOKENS:
            raise ValueError(f"request {r.request_id}: prompt of {r.prompt_len} tokens, but its prefix alone is "
                             f"{prefix_len} (its own part must be 1..{MAX_OWN_TOKENS} tokens)")
        base = OWN_IDS_BASE + r.request_id * MAX_OWN_TOKENS
        return prefix + list(range(base, base + own))

    return tokens


def few_shot(shots: int, num_requests: int, *, rate: float | None = None, seed: int = 0,
             max_seq_len: int = 2048) -> tuple[Request, ...]:
    """The paper's translation requests (Fig. 16) behind a ``shots``-shot prefix (1: 80 tokens, 5: 341);
    prompt ids from :func:`few_shot_tokens`. Arrivals Poisson at ``rate`` (None: all at 0)."""
    if shots not in FEW_SHOT_PREFIX_LEN:
        raise ValueError(f"shots must be one of {sorted(FEW_SHOT_PREFIX_LEN)}, got {shots!r}")
    if type(num_requests) is not int or num_requests < 1:
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    prefix = FEW_SHOT_PREFIX_LEN[shots]
    rng = np.random.default_rng(seed)
    calib = max(num_requests, 20_000)
    room = (max_seq_len - prefix) // 2
    own = _calibrated_lognormal(rng, calib, TRANSLATION_MEAN_SOURCE, TRANSLATION_SIGMA, room)[:num_requests]
    out = _calibrated_lognormal(rng, calib, TRANSLATION_MEAN_TARGET, TRANSLATION_SIGMA, room)[:num_requests]
    times = np.zeros(num_requests) if rate is None else np.cumsum(rng.exponential(1.0 / rate, num_requests))
    return tuple(Request(i, prefix + int(p), int(o), float(t)) for i, (p, o, t) in enumerate(zip(own, out, times)))


@dataclass(frozen=True, slots=True)
class SpanWorkload:
    """A workload the serving points replay at a rate: ``span(rate, span_s, seed, max_seq_len)`` gives the
    arrivals of ``[0, span_s)`` (independent requests), ``prompt_tokens(request)`` their ids."""

    name: str
    span: Callable[[float, float, int, int], tuple[Request, ...]]
    prompt_tokens: Callable[[Request], list[int]]
    lengths: Callable[[], tuple[float, float]]  # (mean prompt, mean output) tokens, for a low-load rate
    note: str

    @property
    def mean_prompt(self) -> float:
        return self.lengths()[0]

    @property
    def mean_output(self) -> float:
        return self.lengths()[1]


def _enough(rate: float, span_s: float) -> int:
    """More requests than a Poisson span at ``rate`` holds (six standard deviations over)."""
    return max(1, math.ceil(rate * span_s + 6 * math.sqrt(rate * span_s) + 10))


def _in_span(trace: tuple[Request, ...], span_s: float) -> tuple[Request, ...]:
    kept = tuple(r for r in trace if r.arrival_s < span_s)
    return kept or (Request(0, trace[0].prompt_len, trace[0].output_len, 0.0),)


def _few_shot_span(shots: int):
    def span(rate: float, span_s: float, seed: int, max_seq_len: int) -> tuple[Request, ...]:
        return _in_span(few_shot(shots, _enough(rate, span_s), rate=rate, seed=seed, max_seq_len=max_seq_len), span_s)
    return span


def _chatbot_span(rate: float, span_s: float, seed: int, max_seq_len: int) -> tuple[Request, ...]:
    """The chatbot's rounds as independent requests (the paper keeps no KV between rounds), in a
    seed-shuffled order, Poisson at ``rate``."""
    rounds = 4
    trace = chatbot(-(-_enough(rate, span_s) // rounds), rounds, seed=seed,
                    max_history=min(1024, max_seq_len // 2), max_answer=min(1024, max_seq_len // 2))
    rng = np.random.default_rng([seed, 17])
    order = rng.permutation(len(trace.requests))
    times = np.cumsum(rng.exponential(1.0 / rate, len(order)))
    reqs = tuple(Request(i, trace.requests[j].prompt_len, trace.requests[j].output_len, float(t))
                 for i, (j, t) in enumerate(zip(order, times)))
    return _in_span(reqs, span_s)


def _unique_tokens(r: Request) -> list[int]:
    base = OWN_IDS_BASE + r.request_id * MAX_OWN_TOKENS
    return list(range(base, base + r.prompt_len))


@functools.cache  # (drawn when first asked for, not at import)
def _chatbot_means() -> tuple[float, float]:
    t = chatbot(500, 4, seed=0)
    return (sum(r.prompt_len for r in t.requests) / len(t.requests),
            sum(r.output_len for r in t.requests) / len(t.requests))


WORKLOADS: dict[str, SpanWorkload] = {
    **{f"fewshot-{k}": SpanWorkload(f"fewshot-{k}", _few_shot_span(k), few_shot_tokens(n),
                                    lambda n=n: (n + TRANSLATION_MEAN_SOURCE, TRANSLATION_MEAN_TARGET),
                                    f"{k}-shot translation: a {n}-token shared prefix + ~30 tokens of its own")
       for k, n in FEW_SHOT_PREFIX_LEN.items()},
    "chatbot-1024": SpanWorkload("chatbot-1024", _chatbot_span, _unique_tokens, _chatbot_means,
                                 "chatbot rounds (ShareGPT-like, 4 rounds a session), history cut to the last "
                                 "1024 tokens, answers up to 1024"),
}


@functools.cache
def source_sha256() -> str:
    """This module's source hash: a cached serving point of a named workload follows the code that makes it."""
    return hashlib.sha256(open(__file__, "rb").read()).hexdigest()


def workload(name: str) -> SpanWorkload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
