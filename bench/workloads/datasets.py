"""Workloads as data: request traces (prompt/output lengths and arrival times).

A trace is a tuple of :class:`Request`. It comes from a JSONL file (one object per line with
``prompt_len``, ``output_len`` and optionally ``arrival_s``) or from a synthetic generator matching a
dataset's published length statistics (the vLLM paper, §6.1):

=========  ===========  ===========
dataset    mean prompt  mean output
=========  ===========  ===========
sharegpt   161.31       337.99
alpaca     19.31        58.45
=========  ===========  ===========

Lengths are drawn from log-normal distributions whose location is calibrated so that the mean after
clipping (every request fits ``max_seq_len`` tokens) equals the published mean. Arrivals are Poisson at
``rate`` requests/s, or all at time 0 when ``rate`` is None.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class Request:
    request_id: int
    prompt_len: int  # tokens in the prompt (>= 1)
    output_len: int  # tokens the request will generate (>= 1)
    arrival_s: float = 0.0  # arrival time in seconds from the start of the trace
    # ids of the prompt's blocks as a trace gives them (Mooncake: one per 512 tokens; equal ids, equal
    # tokens), so prompts can share prefixes; () when the trace has none
    block_hash_ids: tuple[int, ...] = ()
    # a follow-up (a conversation's next turn): released ``think_s`` after request ``release_after``
    # completes, its ``arrival_s`` then set by the simulator (the trace's value is ignored); None: it
    # arrives at ``arrival_s`` (bench/workloads/sessions.py builds them)
    release_after: int | None = None
    think_s: float = 0.0

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True, slots=True)
class LengthStats:
    mean_prompt: float
    mean_output: float
    sigma_prompt: float  # log-normal shape of prompt lengths
    sigma_output: float  # log-normal shape of output lengths


DATASETS: dict[str, LengthStats] = {
    "sharegpt": LengthStats(161.31, 337.99, sigma_prompt=1.1, sigma_output=0.9),
    "alpaca": LengthStats(19.31, 58.45, sigma_prompt=0.7, sigma_output=0.9),
    # Long-context serving (document QA, code): prompts of about 4K-32K tokens, short answers. Not from
    # the paper; the shape is an assumption stated where it is used.
    "longctx": LengthStats(12000.0, 256.0, sigma_prompt=0.45, sigma_output=0.8),
}


def _calibrated_lognormal(rng: np.random.Generator, n: int, mean: float, sigma: float, hi: int) -> np.ndarray:
    """n integer samples in [1, hi] from a log-normal whose clipped mean is ``mean``."""
    z = rng.standard_normal(n)
    lo_mu, hi_mu = math.log(0.5), math.log(hi)
    for _ in range(60):  # bisection on the location parameter
        mu = 0.5 * (lo_mu + hi_mu)
        m = np.clip(np.rint(np.exp(mu + sigma * z)), 1, hi).mean()
        if m < mean:
            lo_mu = mu
        else:
            hi_mu = mu
    return np.clip(np.rint(np.exp(mu + sigma * z)), 1, hi).astype(np.int64)


def synthetic(dataset: str, num_requests: int, *, rate: float | None = None, seed: int = 0,
              max_seq_len: int = 2048) -> tuple[Request, ...]:
    """A synthetic trace with ``dataset``'s length statistics (see the module docstring)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s or None, got {rate}")
    stats = DATASETS[dataset]
    rng = np.random.default_rng(seed)
    # Calibrate on a large sample so the statistics hold for small traces too, then draw the trace.
    calib = max(num_requests, 20_000)
    prompts = _calibrated_lognormal(rng, calib, stats.mean_prompt, stats.sigma_prompt, max_seq_len - 1)
    outputs = _calibrated_lognormal(rng, calib, stats.mean_output, stats.sigma_output, max_seq_len - 1)
    prompts, outputs = prompts[:num_requests], outputs[:num_requests]
    outputs = np.minimum(outputs, max_seq_len - prompts)  # every request fits the model's max length
    if rate is None:
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    return tuple(
        Request(i, int(p), int(o), float(a)) for i, (p, o, a) in enumerate(zip(prompts, outputs, arrivals))
    )


def json_objects(path: str | Path, error: type[ValueError] = ValueError):
    """``(line number, object)`` for each non-blank line of a JSON-lines file; a line that is not a JSON
    object raises ``error`` naming the file and line."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def load_jsonl(path: str | Path, *, rate: float | None = None, seed: int = 0) -> tuple[Request, ...]:
    """Read a trace; arrivals missing from the file are drawn Poisson at ``rate`` (or all at 0)."""
    rows = []
    for lineno, obj in json_objects(path):
        fields = {}
        for name in ("prompt_len", "output_len"):
            if name not in obj:
                raise ValueError(f"{path}:{lineno}: missing field {name!r}")
            v = obj[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{path}:{lineno}: field {name!r} must be an int >= 1, got {v!r}")
            fields[name] = v
        a = obj.get("arrival_s")
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not a >= 0):
            raise ValueError(f"{path}:{lineno}: field 'arrival_s' must be a number >= 0, got {a!r}")
        rows.append((fields["prompt_len"], fields["output_len"], a))
    if not rows:
        raise ValueError(f"{path}: empty trace")
    rng = np.random.default_rng(seed)
    t = 0.0
    out = []
    for i, (p, o, a) in enumerate(rows):
        if a is None:
            t = t + (rng.exponential(1.0 / rate) if rate else 0.0)
            a = t
        out.append(Request(i, p, o, float(a)))
    return tuple(out)


def save_jsonl(trace: tuple[Request, ...], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps({"prompt_len": r.prompt_len, "output_len": r.output_len,
                                "arrival_s": r.arrival_s}) + "\n")
