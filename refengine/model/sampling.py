"""Sampling parameters and the per-sequence sampler.

Every sequence is sampled from its own logits row with its own ``torch.Generator``, so the token a
sequence draws never depends on which other sequences share its batch.

Seeds. A request with ``SamplingParams(seed=s, n=k)`` has ``k`` children; child ``i`` samples with a
generator seeded ``s + i``. Running child ``i`` alone as ``SamplingParams(seed=s + i, n=1)`` therefore
reproduces it token for token. A request with ``seed=None`` gets ``s`` from :func:`derive_seed` (the
engine's seed and the request's id), so a fresh ``LLM(seed=...)`` given the same calls reproduces it.

The sampler (temperature > 0), on one row of float32 logits ``[vocab_size]``:

1. scale by ``1 / temperature`` (in float64);
2. top-k: keep the ``top_k`` largest logits (``0`` keeps all);
3. softmax; top-p: sort descending, keep the smallest prefix whose probability mass reaches ``top_p``
   (the most likely token is always kept);
4. draw ``u ~ U[0, 1)`` from the sequence's generator (exactly one draw per sampled token) and return
   the first token of the sorted list whose cumulative mass exceeds ``u`` times the kept mass.

``temperature == 0`` is greedy (``argmax``, the first index on ties, as Hugging Face) and draws nothing.
"""

from __future__ import annotations

import math

import torch
from pagedbench.refengine.engine.sampling_params import SamplingParams, derive_seed
from pagedbench.refengine.errors import InvalidArgumentError

__all__ = ["SamplingParams", "child_generator", "derive_seed", "sample_token"]


def child_generator(base_seed: int, child_index: int) -> torch.Generator:
    """The CPU generator of child ``child_index`` of a request whose base seed is ``base_seed``."""
    return torch.Generator(device="cpu").manual_seed((base_seed + child_index) % 2**63)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one sequence's logits.

    logits: float tensor ``[vocab_size]`` (any device); generator: the sequence's own CPU generator
    (unused, and may be None, when greedy). See the module docstring for the exact procedure.
    """
    if logits.dim() != 1:
        raise InvalidArgumentError(f"logits must be 1-D [vocab_size], got shape {tuple(logits.shape)}")
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is None:
        raise InvalidArgumentError("sampling with temperature > 0 needs the sequence's generator")
    x = logits.detach().to("cpu", torch.float64) / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=0)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    cum = torch.cumsum(sorted_probs, dim=0)
    if params.top_p < 1.0:
        # keep token j while the mass before it is still short of top_p (token 0 always kept)
        keep = (cum - sorted_probs) < params.top_p
        sorted_probs = sorted_probs * keep
        cum = torch.cumsum(sorted_probs, dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cum[-1]
    idx = int(torch.searchsorted(cum, u, right=True))
    idx = min(idx, int(torch.count_nonzero(sorted_probs)) - 1)  # guard u*mass rounding to the total
    return int(order[idx])
