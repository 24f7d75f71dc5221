"""Requests released by another's completion: a conversation's next turn arrives ``think_s`` after the
previous answer is out (``Request.release_after``; :mod:`pagedbench.bench.workloads.sessions` builds them).

:class:`FollowUps` splits a trace into the requests that arrive at their own times and the follow-ups,
checks that every follow-up names a request of the trace (no cycle: the chain back from a follow-up
must reach a request with a time of its own), and, told which request completed when, hands back the
follow-ups it releases with their arrival set (completion + think time). The simulator's run keys
requests by the ids its engine gives them (:meth:`watch`) and inserts what :meth:`release` returns into
its pending arrivals.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterable

from pagedbench.bench.workloads import Request


class FollowUps:
    """The follow-ups of a trace, waiting for the completions that release them."""

    def __init__(self, trace: tuple[Request, ...]) -> None:
        ids = {r.request_id for r in trace}
        if len(ids) != len(trace):
            raise ValueError("a trace with follow-ups needs distinct request ids")
        by_id = {r.request_id: r for r in trace}
        self.waiting: dict[int, list[Request]] = {}  # a request's id -> the follow-ups it releases
        for r in trace:
            if r.release_after is None:
                continue
            if r.release_after not in ids:
                raise ValueError(f"request {r.request_id} follows request {r.release_after}, which is not in the trace")
            if not (math.isfinite(r.think_s) and r.think_s >= 0):
                raise ValueError(f"request {r.request_id}: think_s must be finite and >= 0, got {r.think_s!r}")
            seen, at = set(), r
            while at.release_after is not None:  # the chain must reach a request with a time of its own
                if at.request_id in seen:
                    raise ValueError(f"request {r.request_id}: its follow-up chain is a cycle")
                seen.add(at.request_id)
                at = by_id[at.release_after]
            self.waiting.setdefault(r.release_after, []).append(r)
        self.initial = tuple(r for r in trace if r.release_after is None)
        self._keys: dict[Hashable, int] = {}  # the run's key for a request that releases some -> its id

    def __bool__(self) -> bool:
        return bool(self.waiting) or bool(self._keys)

    def watch(self, key: Hashable, r: Request) -> None:
        """``r`` arrived and the run will report its completion as ``key``."""
        if r.request_id in self.waiting:
            self._keys[key] = r.request_id

    def release(self, keys: Iterable[Hashable], end_s: float) -> list[Request]:
        """The follow-ups of the requests completed (as ``keys``) at ``end_s``, arriving their think time later."""
        out = []
        for key in keys:
            rid = self._keys.pop(key, None)
            if rid is not None:
                out.extend(dataclasses.replace(f, arrival_s=end_s + f.think_s) for f in self.waiting.pop(rid))
        return out
