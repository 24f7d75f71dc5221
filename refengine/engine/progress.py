"""``LLM.generate``'s progress bar: finished requests, with output tokens/s in the postfix (as vLLM's)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from pagedbench.refengine.engine.request import Request
from pagedbench.refengine.engine.sequence import Sequence

#: ``use_tqdm=None`` shows the bar above this many requests: a handful finishes before a bar is worth it
AUTO_TQDM_MIN_REQUESTS = 9


def wants_bar(use_tqdm: bool | None, num_requests: int) -> bool:
    """``use_tqdm`` True/False forces the bar on/off; None shows it for more than 8 requests."""
    return num_requests >= AUTO_TQDM_MIN_REQUESTS if use_tqdm is None else bool(use_tqdm)


class GenerateProgress:
    """A tqdm bar over the accepted requests of one generate call, written to stderr.

    A request counts once, when its last child finishes. ``generated_tokens()`` reads the engine's running
    total of sampled tokens; the postfix shows those sampled since the bar opened per wall second.
    """

    def __init__(self, requests: Iterable[Request], generated_tokens: Callable[[], int]) -> None:
        from tqdm import tqdm  # only a call that shows a bar pays for the import

        self._pending = {r.request_id: r for r in requests if r.error is None}
        self._generated_tokens = generated_tokens
        self._tokens_at_start = generated_tokens()
        self._start = time.perf_counter()
        self._bar = tqdm(total=len(self._pending), desc="Processed prompts", unit="req", dynamic_ncols=True)

    def update(self, finished: Iterable[Sequence]) -> None:
        done = 0
        for seq in finished:
            req = self._pending.get(seq.request_id)
            if req is not None and req.finished:
                del self._pending[seq.request_id]
                done += 1
        elapsed = time.perf_counter() - self._start
        tokens = self._generated_tokens() - self._tokens_at_start
        self._bar.set_postfix_str(f"output {tokens / elapsed if elapsed > 0 else 0.0:.1f} tok/s", refresh=False)
        self._bar.update(done)

    def close(self) -> None:
        self._bar.close()
