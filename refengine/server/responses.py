"""Engine stream updates turned into the OpenAI API's response objects (whole, or as SSE chunks).

:class:`ResponseBuilder` follows one request: per completion its text (incrementally detokenized when
the model has a tokenizer), its token ids and finish reason, and the times its tokens came out (for the
metrics). Every choice carries ``token_ids`` besides ``text`` (as vLLM's ``return_token_ids``), so a
client of a model without a tokenizer (``--model tiny``) still sees what was generated.
"""

from __future__ import annotations

import json
import time

from pagedbench.refengine.engine.async_llm import RequestStream, StreamUpdate
from pagedbench.refengine.server.detokenizer import IncrementalDetokenizer
from pagedbench.refengine.server.protocol import finish_reason


class ResponseBuilder:
    """One request's response: ``chat`` picks the chat shapes over the completions' ones."""

    def __init__(self, stream: RequestStream, *, model_name: str, tokenizer, chat: bool) -> None:
        self.stream = stream
        self.model_name = model_name
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}"
        self.created = int(time.time())
        n = stream.num_completions
        self.detok = [IncrementalDetokenizer(tokenizer) if tokenizer is not None else None for _ in range(n)]
        self.text = [""] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.token_times_s: list[float] = []  # one per update that brought tokens
        self.error: str | None = None
        self._role_sent = [False] * n
        self.observed = False  # its metrics were recorded

    @property
    def num_output_tokens(self) -> int:
        return max(len(t) for t in self.token_ids)

    @property
    def finished_reason(self) -> str:
        """The request's finish reason for the metrics (its first completion's; "abort" when cut)."""
        return self.finish[0] or "abort"

    def apply(self, update: StreamUpdate) -> list[tuple[int, str, list[int], str | None]]:
        """Record ``update``; returns per moved completion ``(index, new text, new token ids, finish)``."""
        if update.error is not None:
            self.error = update.error
        if any(d.token_ids for d in update.deltas):
            self.token_times_s.append(update.time_s)
        moved = []
        for d in update.deltas:
            i, ids = d.index, list(d.token_ids)
            self.token_ids[i].extend(ids)
            reason = finish_reason(d.finish_reason)
            text = ""
            if self.detok[i] is not None:
                text = self.detok[i].add(ids, final=reason is not None)
                self.text[i] += text
            self.finish[i] = reason
            moved.append((i, text, ids, reason))
        return moved

    # --- whole responses ----------------------------------------------------------------------------
    def usage(self) -> dict:
        prompt = len(self.stream.prompt_token_ids)
        completion = sum(len(t) for t in self.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def response(self) -> dict:
        choices = []
        for i in range(len(self.text)):
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": self.text[i]},
                                "token_ids": self.token_ids[i], "logprobs": None, "finish_reason": self.finish[i]})
            else:
                choices.append({"index": i, "text": self.text[i], "token_ids": self.token_ids[i], "logprobs": None,
                                "finish_reason": self.finish[i]})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices, "usage": self.usage()}

    # --- server-sent events -------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def sse_chunks(self, update: StreamUpdate) -> list[str]:
        """One SSE event per completion that moved in ``update``."""
        out = []
        for i, text, ids, reason in self.apply(update):
            if self.chat:
                delta: dict = {"content": text}
                if not self._role_sent[i]:
                    delta["role"] = "assistant"
                    self._role_sent[i] = True
                choice = {"index": i, "delta": delta, "token_ids": ids, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": i, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": reason}
            out.append(self._chunk([choice]))
        return out

    def sse_usage(self) -> str:
        return self._chunk([], self.usage())


def sse_error(message: str, status: int) -> str:
    return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'code': status}})}\n\n"


SSE_DONE = "data: [DONE]\n\n"
