"""What ``LLM.generate`` returns: one :class:`RequestOutput` per prompt, in the prompts' order."""

from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("length", "stop", "eos", "abort")


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One completion (child) of a request. Lists, as vLLM's offline API returns them.

    ``finish_reason``: "length" (``max_tokens`` reached, or the model's maximum length), "stop" (a
    ``stop_token_ids`` token was generated, it is the last of ``token_ids``; or a ``stop`` string appeared in
    the text: ``text`` ends before it, ``token_ids`` with the token that completed it), "eos" (the model's EOS
    token was generated; it is the last of ``token_ids``), "abort" (``LLM.abort``, or its request's
    ``error`` was set by a failed step: ``token_ids`` holds what was generated until then).
    """

    token_ids: list[int]  # generated tokens (the prompt excluded)
    finish_reason: str  # one of FINISH_REASONS
    index: int = 0  # child index in [0, n)
    text: str | None = None  # the decoded tokens when the model folder has a tokenizer
    # with SamplingParams(logprobs=k): per generated token, {token_id: logprob} of the sampled token and
    # the k most likely (the model's raw distribution, before temperature/top-k/top-p; vLLM v1's default)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs (with logprobs)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The outcome of one prompt.

    A rejected request has ``error`` set (why: empty prompt, token outside the vocabulary, too long,
    can never fit the KV pool, ...), ``outputs == []`` and ``num_cached_tokens == 0``; the other
    requests of the same ``generate`` call are unaffected. A request aborted after a failed step has
    ``error`` set too (the failure), and its ``outputs`` end with ``finish_reason == "abort"``.
    """

    request_id: int  # unique within one LLM
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n completions, by index
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first admission
    prompt: str | None = None  # the prompt text when one was given
    error: str | None = None  # None for a served request

    @property
    def finished(self) -> bool:
        return self.error is None
