"""Repetition, frequency and presence penalties on a step's logits rows (vLLM's ``apply_penalties``).

For one row of float32 logits ``[V]`` of a sequence whose prompt is ``P`` and whose generated tokens so far
are ``O`` (``count[t]``: how often token ``t`` occurs in ``O``), in this order:

1. repetition: for every token in ``P`` or ``O``, a logit ``> 0`` is divided by ``repetition_penalty``,
   a logit ``<= 0`` multiplied by it (Keskar et al.; prompt tokens count);
2. frequency: ``logit[t] -= frequency_penalty * count[t]`` (generated tokens only, OpenAI's definition);
3. presence: ``logit[t] -= presence_penalty`` for every ``t`` in ``O`` (generated tokens only).

The penalised logits are what the sampler then scales by temperature, cuts by top-k/top-p, or takes the
argmax of; the log-probabilities reported stay the raw ones (``engine.logprobs``), as vLLM v1's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from pagedbench.refengine.engine.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """What the penalties read of a sequence (``engine.sequence.Sequence`` is one)."""

    token_ids: Sequence[int]  # the prompt followed by the tokens generated so far
    num_prompt_tokens: int  # how many of token_ids are the prompt


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[TokenHistory]) -> torch.Tensor:
    """The rows of float ``[R, V]`` ``logits`` with each row's penalties applied (see the module
    docstring): a new tensor, ``logits`` untouched. Only the rows whose ``params[r].penalized`` are
    computed; the others are copied as they are."""
    rows = [r for r, p in enumerate(params) if p.penalized]
    out = logits.clone()
    if not rows:
        return out
    device, vocab = logits.device, logits.shape[1]
    x = logits[torch.tensor(rows, device=device)].float()
    prompts = [histories[r].token_ids[:histories[r].num_prompt_tokens] for r in rows]
    outputs = [histories[r].token_ids[histories[r].num_prompt_tokens:] for r in rows]
    out_counts = _token_counts(outputs, vocab, device)
    seen = (_token_counts(prompts, vocab, device) > 0) | (out_counts > 0)
    column = lambda name: torch.tensor([getattr(params[r], name) for r in rows],  # noqa: E731
                                       dtype=torch.float32, device=device)[:, None]
    rep = column("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - column("frequency_penalty") * out_counts
    x = x - column("presence_penalty") * (out_counts > 0)
    out[torch.tensor(rows, device=device)] = x.to(out.dtype)
    return out


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """float32 ``[len(token_lists), vocab]``: how often each token id occurs in each list."""
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.int64)  # vocab: a padding column
    for i, t in enumerate(token_lists):
        ids[i, :len(t)] = torch.as_tensor(list(t), dtype=torch.int64)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab].to(device)
