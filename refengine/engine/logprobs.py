"""Log-probabilities for ``SamplingParams(logprobs=k)``, as vLLM returns them.

For each sampled token, a dict ``{token_id: logprob}`` holding the sampled token and the ``k`` most
likely tokens (``k + 1`` entries, or ``k`` when the sampled token is among them; ``k = 0``: the sampled
token alone). The log-probabilities are those of the model's raw distribution: ``log_softmax`` of the
float32 logits *before* temperature, top-k and top-p (vLLM v1's default, ``logprobs_mode="raw_logprobs"``),
so they say how likely the model found each token, whatever the sampler then did.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int],
                   num_logprobs: Sequence[int | None]) -> list[dict[int, float] | None]:
    """One dict per row of float ``[R, vocab_size]`` ``logits`` (any device) whose ``num_logprobs[r]`` is
    not None: ``tokens[r]`` (the token row ``r`` sampled) and row ``r``'s ``num_logprobs[r]`` most likely
    tokens, to their log-probability (see the module docstring); None for the other rows."""
    rows = [r for r, k in enumerate(num_logprobs) if k is not None]
    out: list[dict[int, float] | None] = [None] * len(num_logprobs)
    if not rows:
        return out
    device = logits.device
    lp = torch.log_softmax(logits[torch.tensor(rows, device=device)].float(), dim=-1)
    picked = lp.gather(1, torch.tensor([tokens[r] for r in rows], device=device)[:, None])[:, 0].tolist()
    widest = max(num_logprobs[r] for r in rows)
    top_vals, top_ids = torch.topk(lp, widest, dim=-1) if widest else (None, None)
    if widest:
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for i, r in enumerate(rows):
        entry = {tokens[r]: picked[i]}  # the sampled token first, as vLLM
        k = num_logprobs[r]
        if k:
            entry.update(zip(top_ids[i][:k], top_vals[i][:k]))
        out[r] = entry
    return out
