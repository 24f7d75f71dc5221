"""The OpenAI API's request bodies (the fields this server serves) and their translation to engine
arguments: a prompt as ``LLM.add_request`` takes it and a :class:`SamplingParams`.

Bodies are pydantic models, so a malformed one (a missing field, a wrong type) is a 422 before any
translation; so is an integer beyond 64 bits. Unknown fields are ignored, as vLLM does, so clients
that send more (``user``...) still work; fields the engine cannot honour (``tools``, ``tool_choice``,
``response_format``, ``logit_bias``, ``best_of``: ``_OFF`` lists them) are refused with a
400 naming them (:class:`UnsupportedError`) unless left at their "off" value, rather than silently
ignored.

Extra parameters, as vLLM's: ``ignore_eos``, ``min_tokens``, ``top_k`` (-1 or 0: off),
``stop_token_ids``, ``include_stop_str_in_output`` and ``repetition_penalty`` (beside OpenAI's
``presence_penalty`` and ``frequency_penalty``; the engine's sampler applies all three as vLLM does).
``stop`` strings end a completion in the engine (``engine/stop_strings.py``). ``logprobs`` are the
model's raw log-probabilities (before temperature and truncation), at most :data:`MAX_LOGPROBS` per
position, as vLLM's default ``max_logprobs``. ``/v1/completions`` takes a list of prompts (a batch:
one request per prompt) and ``echo``; ``echo`` with ``logprobs`` needs the prompt's logprobs, which the
engine does not compute, and is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pagedbench.refengine.engine.sampling_params import SamplingParams
from pydantic import BaseModel, ConfigDict, Field

# JSON integers have no bound, the engine's (token ids, seeds, counts) are 64-bit: a larger one is a
# malformed body (422) rather than an overflow deep in torch
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]

# Fields of OpenAI's (or vLLM's) API this server does not honour, with the value that means "off":
# a request setting one otherwise is refused (400) rather than silently served without it
_OFF: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}), "logit_bias": (None, {}),
    "suffix": (None, ""), "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "use_beam_search": (None, False),
    "prompt_logprobs": (None,), "logits_processors": (None,), "bad_words": (None, []),
}


def first_invalid_text(value, where: str) -> str | None:
    """The path of the first string in ``value`` (nested lists and dicts) that is not valid Unicode (a lone
    surrogate such as "\ud800", which JSON allows and no tokenizer can encode), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = first_invalid_text(item, (f"{where}.{key}" if where else key) if isinstance(key, str)
                                   else f"{where}[{key}]")
        if found is not None:
            return found
    return None


def generation_defaults(folder: str | None) -> dict[str, Any]:
    """The sampling defaults a model folder's ``generation_config.json`` gives (``temperature``, ``top_p``,
    ``top_k``), applied where a request leaves them out, as vLLM does (``--generation-config auto``): a
    model tuned for a low temperature answers well from its first request. Values of the wrong type or
    range are left out (OpenAI's defaults stand)."""
    path = Path(folder) / "generation_config.json" if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    if doc.get("do_sample") is False:  # the model's own generate() would decode greedily
        return {"temperature": 0.0}
    out: dict[str, Any] = {}
    t, p, k = doc.get("temperature"), doc.get("top_p"), doc.get("top_k")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0:
        out["temperature"] = float(t)
    if isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1:
        out["top_p"] = float(p)
    if isinstance(k, int) and not isinstance(k, bool) and k >= 0:
        out["top_k"] = k
    return out


MAX_LOGPROBS = 20


class UnsupportedError(ValueError):
    """A request field this server does not serve (400), naming it."""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to refuse the unsupported ones (see _OFF)

    model: str | None = None
    max_tokens: Int64 | None = Field(default=None, ge=1)
    # None: the model folder's generation_config.json default, else OpenAI's (1.0, 1.0, off)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: Int64 | None = Field(default=None, ge=-1)
    n: Int64 = Field(default=1, ge=1)
    seed: Int64 | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = Field(default=0, ge=0)
    logprobs: Int64 | bool | None = None
    best_of: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def sampling_params(self, default_max_tokens: int, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters; :class:`UnsupportedError` for a field it cannot honour, the engine's
        ``InvalidArgumentError`` for values out of range (``min_tokens > max_tokens``, ...)."""
        unsupported = [name for name, off in _OFF.items()
                       if name in (self.model_extra or {}) and self.model_extra[name] not in off]
        if self.best_of not in (None, 1):
            unsupported.append("best_of")
        if unsupported:
            raise UnsupportedError(f"unsupported by this server: {', '.join(unsupported)}")
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self._or_default("temperature", defaults, 1.0), top_p=self._or_default("top_p", defaults, 1.0),
            top_k=max(self._or_default("top_k", defaults, 0), 0), n=self.n, seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logprobs=self.num_logprobs(), stop=self.stop_strings(),
            include_stop_str_in_output=self.include_stop_str_in_output)

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not x for x in stops):
            raise UnsupportedError("stop strings must be non-empty")
        return stops

    def num_logprobs(self) -> int | None:
        """Top tokens per position to return logprobs for (None: no logprobs), as this endpoint spells it."""
        raise NotImplementedError

    @staticmethod
    def _bounded_logprobs(k: int, name: str) -> int:
        if not 0 <= k <= MAX_LOGPROBS:
            raise UnsupportedError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        return k

    def _or_default(self, name: str, defaults: Mapping[str, Any] | None, openai: Any) -> Any:
        value = getattr(self, name)
        if value is not None:
            return value
        return (defaults or {}).get(name, openai)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    echo: bool = False

    def num_logprobs(self) -> int | None:
        if self.logprobs is None or self.logprobs is False:
            return None
        if self.logprobs is True:  # the chat endpoint's spelling
            raise UnsupportedError("logprobs of /v1/completions is the number of top tokens (an int), got true")
        if self.echo:
            raise UnsupportedError("echo with logprobs needs the prompt's logprobs, which this server does not "
                                   "compute")
        return self._bounded_logprobs(self.logprobs, "logprobs")

    def engine_prompts(self) -> list[dict]:
        """The prompts as the engine takes them, each a string or a list of token ids: one, or a batch."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in batch]

    def engine_prompt(self):
        """The prompt as the engine takes it, for a request of one prompt."""
        prompts = self.engine_prompts()
        if len(prompts) != 1:
            raise UnsupportedError(f"engine_prompt takes one prompt, got a batch of {len(prompts)}")
        return prompts[0]


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
    max_completion_tokens: Int64 | None = Field(default=None, ge=1)
    top_logprobs: Int64 | None = None

    def num_logprobs(self) -> int | None:
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise UnsupportedError(f"logprobs of /v1/chat/completions is a bool (top_logprobs gives the number), "
                                   f"got {self.logprobs}")
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise UnsupportedError("top_logprobs needs logprobs: true")
            return None
        return self._bounded_logprobs(self.top_logprobs or 0, "top_logprobs")

    def sampling_params(self, default_max_tokens: int, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(default_max_tokens, defaults)

    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` (rendered with the template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompts only (a chat template writes its own)

    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages or ()]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Int64]


def finish_reason(engine_reason: str | None) -> str | None:
    """The API's finish reason: the engine's "eos" and "stop" are both "stop"."""
    return "stop" if engine_reason == "eos" else engine_reason


def error_body(message: str, status: int, *, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
