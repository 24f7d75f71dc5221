"""Where an engine step's time goes: attention (the backend's ``forward``: KV write and paged attention),
the rest of the model's forward (projections, MLP, norms, LM head), and the host (scheduling, input
preparation, sampling and everything else the step waits on).

The engine's own objects are wrapped, nothing in it changes: ``ModelExecutor.run_model`` and the
attention backend's ``forward`` are timed with a :class:`Timer` around each call. On a GPU the timer
records CUDA events on the current stream and reads them once at the end (no synchronisation inside the
step, which would move time from the host to the device); on the CPU it reads ``perf_counter``. The step
itself is timed on the wall clock (its sampled tokens come back to the host, so a step ends when its
device work has). ``host = step - forward``, ``rest = forward - attention``.

``make gpu-check``'s ``engine`` check runs it for the paged and the contiguous allocator, to say which
part the paged engine's gap to contiguous lies in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


class Timer:
    """Intervals measured around calls; :meth:`total_ms` reads them all at the end."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._spans: list[tuple] = []

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = self._mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self._spans.append((start, self._mark()))
        return timed

    def _mark(self):
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def total_ms(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self._spans)
        return 1e3 * sum(b - a for a, b in self._spans)

    @property
    def calls(self) -> int:
        return len(self._spans)


@dataclass(frozen=True)
class Breakdown:
    steps: int
    step_ms: float  # per step, wall clock
    forward_ms: float  # per step, the model's forward
    attention_ms: float  # per step, the attention backend's forward (all layers)

    @property
    def rest_ms(self) -> float:
        return self.forward_ms - self.attention_ms

    @property
    def host_ms(self) -> float:
        return self.step_ms - self.forward_ms

    def as_dict(self) -> dict:
        return {"steps": self.steps, "step_ms": self.step_ms, "forward_ms": self.forward_ms,
                "attention_ms": self.attention_ms, "rest_ms": self.rest_ms, "host_ms": self.host_ms}

    def line(self) -> str:
        return (f"{self.step_ms:.2f} ms/step: attention {self.attention_ms:.2f}, rest of forward {self.rest_ms:.2f}, "
                f"host {self.host_ms:.2f}")


def measure(llm, prompts, params, *, cuda: bool) -> Breakdown:
    """Serve ``prompts`` through ``llm.step`` with the executor's forward and the attention backend timed;
    the per-step means over the run. The wrappers are removed after, whatever happens."""
    executor = llm.executor
    backend = getattr(llm.model, "attention_backend", None)
    if backend is None or not hasattr(executor, "run_model"):
        raise ValueError("this engine has no attention_backend or run_model to time")
    forward, attention = Timer(cuda), Timer(cuda)
    executor.run_model = forward.wrap(executor.run_model)
    backend.forward = attention.wrap(backend.forward)
    try:
        for p in prompts:
            llm.add_request(p, params)
        steps, wall = 0, 0.0
        while llm.scheduler.has_unfinished():
            start = time.perf_counter()
            llm.step()
            wall += time.perf_counter() - start
            steps += 1
    finally:
        del executor.run_model, backend.forward  # the instance attributes: the class's methods again
    if steps == 0:
        raise ValueError("no step ran: nothing to break down")
    return Breakdown(steps, 1e3 * wall / steps, forward.total_ms() / steps, attention.total_ms() / steps)
