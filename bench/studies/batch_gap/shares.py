"""Two readings of one run's KV memory: the serving study's share of the pool, and the paper's share of
the memory held by requests; and the mean batch weighted by steps or by time.

The serving study (:mod:`pagedbench.bench.sim.accounting`) splits every measured step's pool into token
states, reserved (held, to be filled by the request later: for paged, the unfilled tail of its last
block), internal fragmentation (held, never to be filled), external fragmentation and the free pool, and
reports each as a share of the *whole pool*, free slots included. The vLLM paper's Fig. 2 reads "token
states" against the KV memory the requests hold (we assume: tokens / (tokens + reserved + internal
fragmentation)); the free pool is no waste there. Both are averaged over the same steps, as the serving
study averages: every step starting inside the measured window weighs the same::

    of pool   = sum(token) / (num_steps x pool slots)
    of held   = sum(token) / sum(token + reserved + internal)

The mean batch is the serving study's (running requests averaged over the same steps) and, beside it, the
time-weighted one (each step weighs its length up to the next step's start: an idle gap after a step
counts with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedbench.bench.sim.records import StepRecord


@dataclass(frozen=True, slots=True)
class PoolReading:
    token_of_pool: float  # token states / the whole pool (the serving study's share)
    token_of_held: float  # token states / the slots requests hold (the paper's, as we read it)
    reserved_of_pool: float
    internal_of_pool: float
    free_of_pool: float  # free slots, external fragmentation included
    mean_batch: float  # running requests, each measured step weighing the same (the serving study's)
    mean_batch_time_weighted: float
    num_steps: int  # steps starting inside the window


def read_pool(steps: Sequence[StepRecord], total_slots: int, window: tuple[float, float]) -> PoolReading:
    """The :class:`PoolReading` of the ``steps`` that start inside ``window`` (module docstring)."""
    if total_slots < 1:
        raise ValueError(f"total_slots must be >= 1, got {total_slots}")
    w0, w1 = window
    idx = [i for i, s in enumerate(steps) if w0 <= s.time_s <= w1]
    if not idx:
        raise ValueError(f"no step starts inside the window {window} ({len(steps)} steps)")
    tok = sum(steps[i].token_states for i in idx)
    res = sum(steps[i].reserved for i in idx)
    inte = sum(steps[i].internal_fragmentation for i in idx)
    free = sum(steps[i].free + steps[i].external_fragmentation for i in idx)
    n = len(idx)
    held = tok + res + inte
    pool = n * total_slots
    weighted = total = 0.0
    for i in idx:
        if i + 1 < len(steps):  # the last step's length is not known: it is left out of the time weights
            dt = steps[i + 1].time_s - steps[i].time_s
            weighted += dt * steps[i].num_running
            total += dt
    return PoolReading(tok / pool, tok / held if held else 0.0, res / pool, inte / pool, free / pool,
                       sum(steps[i].num_running for i in idx) / n, weighted / total if total else 0.0, n)
