"""Shared set-up of the micro-benchmarks (``-m micro``; ``make bench-micro``, ``make bench-compare``).

Each benchmark times one host-side hot path on a fixed workload, with its state built in ``setup``,
outside the timed region, fresh for every round. ``PAGEDBENCH_MICRO_ROUNDS`` sets the rounds per
benchmark (default 20): ``bench/compare.py`` runs many short invocations rather than one long one.
These files import the engine by module path only, so they also time an older commit's code (``compare.py``
runs this tree's benchmarks against both implementations).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

ROUNDS = int(os.environ.get("PAGEDBENCH_MICRO_ROUNDS", "20"))


@pytest.fixture
def run_micro(benchmark) -> Callable:
    """``run_micro(target, setup)``: time ``target(*setup())`` for ROUNDS rounds (one warm-up round)."""

    def run(target: Callable, setup: Callable[[], tuple]) -> None:
        benchmark.pedantic(target, setup=lambda: (setup(), {}), rounds=ROUNDS, warmup_rounds=1, iterations=1)

    return run
