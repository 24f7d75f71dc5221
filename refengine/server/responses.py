"""Engine stream updates turned into the OpenAI API's response objects (whole, or as SSE chunks).

:class:`ResponseBuilder` follows one request: per completion its text (incrementally detokenized when
the model has a tokenizer), its token ids, logprobs and finish reason, and the times its tokens came out
(for the metrics). Every choice carries ``token_ids`` besides ``text`` (as vLLM's ``return_token_ids``),
so a client of a model without a tokenizer (``--model tiny``) still sees what was generated.

Stop strings are matched by the engine, which ends the completion and sends the text cut before the
stop string. A stream never sends text it may have to take back: while a completion runs, the last
``len(longest stop) - 1`` characters are held back (a stop string could begin there), and sent once the
next tokens show they are not one, or when the completion ends.

A ``/v1/completions`` call with a list of prompts is one request per prompt: choice ``p * n + i`` is
completion ``i`` of prompt ``p`` (OpenAI's numbering), :func:`batch_response` joins their responses.
"""

from __future__ import annotations

import json
import time

from pagedbench.refengine.engine.async_llm import RequestStream, StreamUpdate
from pagedbench.refengine.engine.detokenizer import IncrementalDetokenizer
from pagedbench.refengine.server.protocol import finish_reason


def token_text(tokenizer, token_id: int) -> str:
    """A token as a logprobs entry names it: its decoded text, or ``token_id:N`` without a tokenizer
    (vLLM's ``return_tokens_as_token_ids`` spelling)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


class ResponseBuilder:
    """One request's response: ``chat`` picks the chat shapes over the completions' ones.

    ``hold``: characters a running completion's stream holds back (longest stop string - 1);
    ``echo``: text put before each completion's (the prompt, for ``echo``); ``logprobs``: the number of
    top tokens per position when the response includes logprobs (None: it does not);
    ``first_index``: the first choice's index (``p * n`` for prompt ``p`` of a batch).
    """

    def __init__(self, stream: RequestStream, *, model_name: str, tokenizer, chat: bool, hold: int = 0,
                 echo: str = "", logprobs: int | None = None, first_index: int = 0,
                 request_id: str | None = None) -> None:
        self.stream = stream
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.chat = chat
        self.hold, self.echo, self.first_index = hold, echo, first_index
        self.want_logprobs, self.num_logprobs = logprobs is not None, logprobs or 0
        self.id = request_id or f"{'chatcmpl' if chat else 'cmpl'}-{stream.request_id}"
        self.created = int(time.time())
        n = stream.num_completions
        self.detok = [IncrementalDetokenizer(tokenizer) if tokenizer is not None else None for _ in range(n)]
        self.text = [""] * n
        self.sent = [0] * n  # characters of text streamed
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[dict[int, float]]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.token_times_s: list[float] = []  # one per update that brought tokens
        self.error: str | None = None
        self.num_cached_tokens = 0  # the prompt's tokens the prefix cache served
        self._role_sent = [False] * n
        self._offsets = [(0, len(echo))] * n  # per completion: (tokens, characters) its text offset has passed
        self.observed = False  # its metrics were recorded

    @property
    def num_output_tokens(self) -> int:
        return max(len(t) for t in self.token_ids)

    @property
    def finished_reason(self) -> str:
        """The request's finish reason for the metrics (its first completion's; "abort" when cut)."""
        return self.finish[0] or "abort"

    def apply(self, update: StreamUpdate) -> list[tuple[int, str, list[int], list[dict], str | None]]:
        """Record ``update``; returns per moved completion ``(index, text to send, new token ids, their
        logprobs, finish)``."""
        if update.error is not None:
            self.error = update.error
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        if any(d.token_ids for d in update.deltas):
            self.token_times_s.append(update.time_s)
        moved = []
        for d in update.deltas:
            i, ids = d.index, list(d.token_ids)
            start = len(self.token_ids[i])
            self.token_ids[i].extend(ids)
            if d.logprobs is not None:
                self.logprobs[i].extend(d.logprobs)
            reason = finish_reason(d.finish_reason)
            if self.detok[i] is not None:
                self.text[i] += self.detok[i].add(ids, final=reason is not None)
            if d.text is not None:  # a stop string ended it: the engine's text, cut there
                self.text[i] = d.text
            self.finish[i] = reason
            ready = len(self.text[i]) if reason is not None else max(self.sent[i], len(self.text[i]) - self.hold)
            text, self.sent[i] = self.text[i][self.sent[i]:ready], ready
            moved.append((i, text, ids, self.logprobs[i][start:] if self.want_logprobs else [], reason))
        return moved

    # --- logprobs in the API's two shapes ----------------------------------------------------------
    def _chat_logprobs(self, ids: list[int], entries: list[dict]) -> dict:
        content = []
        for t, entry in zip(ids, entries):
            # the entry holds the sampled token and the k most likely: the top k are the k largest
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:self.num_logprobs]
            content.append({**self._chat_token(t, entry[t]), "top_logprobs": [self._chat_token(k, v) for k, v in top]})
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text = token_text(self.tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _completion_logprobs(self, ids: list[int], entries: list[dict], offset: int) -> dict:
        tokens, offsets = [], []
        for t in ids:
            tokens.append(token_text(self.tokenizer, t))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(ids, entries)],
                "top_logprobs": [{token_text(self.tokenizer, k): v for k, v in e.items()} for e in entries],
                "text_offset": offsets}

    def _logprobs(self, i: int, ids: list[int], entries: list[dict], start: int) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return self._chat_logprobs(ids, entries)
        return self._completion_logprobs(ids, entries, self._offset_of(i, start))

    def _offset_of(self, i: int, start: int) -> int:
        """Where completion ``i``'s token ``start`` begins in its text (echo included), advanced from the
        last chunk's offset rather than summed from the first token again."""
        count, offset = self._offsets[i] if self._offsets[i][0] <= start else (0, len(self.echo))
        offset += sum(len(token_text(self.tokenizer, t)) for t in self.token_ids[i][count:start])
        self._offsets[i] = (start, offset)
        return offset

    # --- whole responses ----------------------------------------------------------------------------
    def usage(self) -> dict:
        prompt = len(self.stream.prompt_token_ids)
        completion = sum(len(t) for t in self.token_ids)
        # vLLM's shape (its --enable-prompt-tokens-details): clients such as aiperf read the prefix cache's share
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    def choices(self) -> list[dict]:
        out = []
        for i in range(len(self.text)):
            lp = self._logprobs(i, self.token_ids[i], self.logprobs[i], 0)
            if self.chat:
                out.append({"index": self.first_index + i, "message": {"role": "assistant", "content": self.text[i]},
                            "token_ids": self.token_ids[i], "logprobs": lp, "finish_reason": self.finish[i]})
            else:
                out.append({"index": self.first_index + i, "text": self.echo + self.text[i],
                            "token_ids": self.token_ids[i], "logprobs": lp, "finish_reason": self.finish[i]})
        return out

    def response(self) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": self.choices(), "usage": self.usage()}

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
        for i, text, ids, entries, reason in self.apply(update):
            lp = self._logprobs(i, ids, entries, len(self.token_ids[i]) - len(ids))
            index = self.first_index + i
            if self.chat:
                delta: dict = {"content": text}
                if not self._role_sent[i]:
                    delta["role"] = "assistant"
                    self._role_sent[i] = True
                choice = {"index": index, "delta": delta, "token_ids": ids, "logprobs": lp, "finish_reason": reason}
            else:
                if self.echo and not self._role_sent[i]:  # the echoed prompt leads the first chunk
                    text, self._role_sent[i] = self.echo + text, True
                choice = {"index": index, "text": text, "token_ids": ids, "logprobs": lp, "finish_reason": reason}
            out.append(self._chunk([choice]))
        return out

    def sse_usage(self, usage: dict | None = None) -> str:
        return self._chunk([], usage or self.usage())


def batch_usage(builders: list[ResponseBuilder]) -> dict:
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
             "prompt_tokens_details": {"cached_tokens": 0}}
    for b in builders:
        for k, v in b.usage().items():
            if isinstance(v, dict):
                usage[k]["cached_tokens"] += v["cached_tokens"]
            else:
                usage[k] += v
    return usage


def batch_response(builders: list[ResponseBuilder]) -> dict:
    """One response for a batch of prompts: every request's choices, in index order, usage summed."""
    first = builders[0]
    return {"id": first.id, "object": "text_completion", "created": first.created, "model": first.model_name,
            "choices": [c for b in builders for c in b.choices()], "usage": batch_usage(builders)}


def sse_error(message: str, status: int) -> str:
    return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'code': status}})}\n\n"


SSE_DONE = "data: [DONE]\n\n"
