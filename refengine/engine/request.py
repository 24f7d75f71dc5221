"""A request: one prompt, its sampling parameters, the sequences (children) serving it, its output."""

from __future__ import annotations

import math

from pagedbench.refengine.engine.outputs import CompletionOutput, RequestOutput
from pagedbench.refengine.engine.sampling_params import SamplingParams
from pagedbench.refengine.engine.sequence import Sequence


class Request:
    """One prompt of a generate call (or of a simulated trace): its children and, once done, its output."""

    __slots__ = ("arrival_s", "cache_salt", "children", "error", "params", "prompt", "prompt_token_ids",
                 "queued", "request_id")

    def __init__(self, request_id: int, prompt_token_ids: tuple[int, ...], prompt: str | None,
                 params: SamplingParams, error: str | None, *, cache_salt: str | None = None,
                 arrival_s: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.prompt = prompt
        self.params = params
        self.error = error
        self.cache_salt = cache_salt
        self.arrival_s = arrival_s  # engine clock when it was queued
        self.children: list[Sequence] = []
        self.queued: list[Sequence] = []  # the sequences given to the scheduler

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.children)

    @property
    def finish_s(self) -> float | None:
        """When its last child finished (None until then)."""
        times = [s.finish_s for s in self.children]
        return None if not times or None in times else max(times)

    def output(self, tokenizer=None) -> RequestOutput:
        outs = []
        for s in self.children:
            ids = list(s.output_token_ids)
            text = s.output_text
            if text is None and tokenizer is not None:
                text = tokenizer.decode(ids)
            logprobs = cumulative = None
            if s.logprobs is not None:
                logprobs = [dict(e) for e in s.logprobs]
                cumulative = math.fsum(e[t] for t, e in zip(ids, logprobs))
            outs.append(CompletionOutput(ids, s.finish_reason, index=s.child_index, text=text, logprobs=logprobs,
                                         cumulative_logprob=cumulative))
        cached = self.children[0].num_cached_tokens if self.children else 0
        return RequestOutput(self.request_id, list(self.prompt_token_ids), outs, cached or 0,
                             self.prompt, self.error)
