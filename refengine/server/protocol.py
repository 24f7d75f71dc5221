"""The OpenAI API's request bodies (the fields this server serves) and their translation to engine
arguments: a prompt as ``LLM.add_request`` takes it and a :class:`SamplingParams`.

Bodies are pydantic models, so a malformed one (a missing field, a wrong type) is a 422 before any
translation. Unknown fields are ignored, as vLLM does, so clients that send more (``user``,
``logit_bias`` left at its default...) still work. Fields the engine cannot honour are refused with a
400 naming them (:class:`UnsupportedError`) rather than silently ignored: stop *strings*, ``echo``,
``best_of``, penalties, and ``logprobs`` in the response.

Extra parameters, as vLLM's: ``ignore_eos``, ``min_tokens``, ``top_k`` (-1 or 0: off) and
``stop_token_ids``. One prompt per request: a list of prompts (the API allows a batch) is refused.
"""

from __future__ import annotations

from typing import Literal

from pagedbench.refengine.engine.sampling_params import SamplingParams
from pydantic import BaseModel, ConfigDict, Field


class UnsupportedError(ValueError):
    """A request field this server does not serve (400), naming it."""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)  # OpenAI's default
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    logprobs: int | bool | None = None
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters; :class:`UnsupportedError` for a field it cannot honour, the engine's
        ``InvalidArgumentError`` for values out of range (``min_tokens > max_tokens``, ...)."""
        unsupported = []
        if self.stop:
            unsupported.append("stop (strings; use stop_token_ids)")
        if self.logprobs not in (None, False):
            unsupported.append("logprobs")
        if self.best_of not in (None, 1):
            unsupported.append("best_of")
        if self.presence_penalty or self.frequency_penalty:
            unsupported.append("presence_penalty/frequency_penalty")
        if unsupported:
            raise UnsupportedError(f"unsupported by this server: {', '.join(unsupported)}")
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), n=self.n, seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    def engine_prompt(self):
        """The prompt as the engine takes it: a string or a list of token ids."""
        if self.echo:
            raise UnsupportedError("unsupported by this server: echo")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise UnsupportedError(f"one prompt per request, got a batch of {len(p)}")
            p = p[0]
        return {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise UnsupportedError(f"unsupported content part {part.get('type')!r}: only text parts are served")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens)

    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def finish_reason(engine_reason: str | None) -> str | None:
    """The API's finish reason: the engine's "eos" and "stop" are both "stop"."""
    return "stop" if engine_reason == "eos" else engine_reason


def error_body(message: str, status: int, *, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
