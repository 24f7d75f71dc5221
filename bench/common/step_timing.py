"""Host time per engine step: each step's wall time, less the model's own compute (forward and LM head).

What remains is the engine's host path: scheduler, block manager, block tables and metadata (with the
attention backend's per-step layout, which the executor plans), sampling.
:func:`timed_steps` instruments one ``LLM`` for the duration of a ``with`` block and restores it after.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(slots=True)
class StepTimes:
    step_s: list[float] = field(default_factory=list)  # wall time of every step
    model_s: float = 0.0  # forward and LM head, summed over the steps

    @property
    def host_share(self) -> float | None:
        """(step time - model time) / step time over every step; None before any step."""
        total = sum(self.step_s)
        return 1.0 - self.model_s / total if total > 0 else None

    @property
    def mean_step_ms(self) -> float | None:
        return 1e3 * sum(self.step_s) / len(self.step_s) if self.step_s else None


@contextmanager
def timed_steps(llm) -> Iterator[StepTimes]:
    """Time ``llm``'s steps and its model's forward and LM head while the block runs."""
    times = StepTimes()
    model, core = llm.model, llm.core
    forward, logits, step = model.forward, model.compute_logits, core.step

    def on_model(fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.model_s += time.perf_counter() - t
        return run

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            times.step_s.append(time.perf_counter() - t)

    model.forward, model.compute_logits, core.step = on_model(forward), on_model(logits), timed_step
    try:
        yield times
    finally:  # the instance attributes shadowed the class's methods: removing them restores those
        del model.forward, model.compute_logits, core.step
