"""Sampling parameters and the sampler, batched over a step's rows.

Every sequence is sampled from its own logits row with its own ``torch.Generator``, so the token a
sequence draws never depends on which other sequences share its batch.

Seeds. A request with ``SamplingParams(seed=s, n=k)`` has ``k`` children; child ``i`` samples with a
generator seeded ``s + i``. Running child ``i`` alone as ``SamplingParams(seed=s + i, n=1)`` therefore
reproduces it token for token. A request with ``seed=None`` gets ``s`` from :func:`derive_seed` (the
engine's seed and the request's id), so a fresh ``LLM(seed=...)`` given the same calls reproduces it.

Penalties (``SamplingParams`` presence/frequency/repetition, vLLM's) come first, greedy or not: the
rows of penalised sequences are replaced by their penalised logits (``refengine.model.penalties``), read
from each sequence's own prompt and generated tokens, before anything below. A step none of whose
sequences has a penalty skips this entirely.

The sampler (temperature > 0), on one row of float32 logits ``[vocab_size]``:

1. scale by ``1 / temperature`` (in float64);
2. top-k: keep the ``top_k`` largest logits (``0`` keeps all);
3. softmax; top-p: sort descending, keep the smallest prefix whose probability mass reaches ``top_p``
   (the most likely token is always kept);
4. draw ``u ~ U[0, 1)`` from the sequence's generator (exactly one draw per sampled token) and return
   the first token of the sorted list whose cumulative mass exceeds ``u`` times the kept mass.

``temperature == 0`` is greedy (``argmax``, the first index on ties, as Hugging Face) and draws nothing.

:func:`sample_batch` runs this on every row of a step at once (one argmax for the greedy rows; one
top-k, softmax, sort and top-p for the sampled ones), each row still drawing from its own generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pagedbench.refengine.engine.sampling_params import SamplingParams, derive_seed
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.model.penalties import TokenHistory, apply_penalties

__all__ = ["SamplingParams", "child_generator", "derive_seed", "greedy_tokens", "kept_distribution",
           "rewind_generator", "sample_batch", "sample_token"]


def child_generator(base_seed: int, child_index: int) -> torch.Generator:
    """The CPU generator of child ``child_index`` of a request whose base seed is ``base_seed``."""
    return torch.Generator(device="cpu").manual_seed((base_seed + child_index) % 2**63)


def rewind_generator(generator: torch.Generator, num_draws: int) -> None:
    """Put a child's generator back where it was after ``num_draws`` draws (its seed, then that many of
    :func:`sample_batch`'s draws): how a failed step's draws are undone."""
    generator.manual_seed(generator.initial_seed())
    for _ in range(num_draws):
        torch.rand((), generator=generator, dtype=torch.float64)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one sequence's logits.

    logits: float tensor ``[vocab_size]`` (any device); generator: the sequence's own CPU generator
    (unused, and may be None, when greedy). See the module docstring for the exact procedure.
    """
    if logits.dim() != 1:
        raise InvalidArgumentError(f"logits must be 1-D [vocab_size], got shape {tuple(logits.shape)}")
    return sample_batch(logits[None], [params], [generator])[0]


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 histories: Sequence[TokenHistory] | None = None) -> list[int]:
    """One token id per row of ``logits`` float ``[R, vocab_size]`` (any device), row ``r`` sampled with
    ``params[r]`` and its own ``generators[r]`` (exactly one draw per sampled row, none for a greedy one).
    ``histories[r]``: row ``r``'s sequence (its prompt and generated tokens), read only when some row has
    a penalty (then required). ``logits`` itself is never modified.

    The greedy rows share one ``argmax``; the sampled rows one pass of the module docstring's procedure
    (:func:`kept_distribution`, then the draws), so a row's token depends only on its own logits,
    parameters and generator, never on the other rows.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(generators) != len(params):
        raise InvalidArgumentError(
            f"logits must be [R, vocab_size] with one params and one generator per row; got shape "
            f"{tuple(logits.shape)}, {len(params)} params, {len(generators)} generators")
    if any(p.penalized for p in params):
        if histories is None or len(histories) != len(params):
            raise InvalidArgumentError(
                f"penalties need one token history per row; got {None if histories is None else len(histories)} "
                f"for {len(params)} rows")
        logits = apply_penalties(logits, params, histories)
    if all(p.greedy for p in params):  # the commonest step: one argmax
        return greedy_tokens(logits)
    is_greedy = [p.greedy for p in params]
    tokens = [0] * len(params)
    greedy = [r for r, g in enumerate(is_greedy) if g]
    if greedy:
        picked = greedy_tokens(logits[torch.tensor(greedy, device=logits.device)])
        for r, t in zip(greedy, picked):
            tokens[r] = t
    sampled = [r for r, g in enumerate(is_greedy) if not g]
    if any(generators[r] is None for r in sampled):
        raise InvalidArgumentError("sampling with temperature > 0 needs the sequence's generator")
    rows = logits[torch.tensor(sampled, device=logits.device)].detach().to("cpu", torch.float64)
    kept = kept_distribution(rows, [params[r] for r in sampled])
    u = torch.stack([torch.rand((), generator=generators[r], dtype=torch.float64) for r in sampled])
    idx = torch.searchsorted(kept.cum, (u * kept.cum[:, -1])[:, None], right=True)[:, 0]
    # guard u * mass rounding up to the total: never step past the last kept token
    idx = torch.minimum(idx, torch.count_nonzero(kept.sorted_probs, dim=-1) - 1)
    for r, t in zip(sampled, kept.order.gather(1, idx[:, None])[:, 0].tolist()):
        tokens[r] = t
    return tokens


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of float ``[R, vocab_size]`` logits (the first index on ties, NaN counting as the
    largest, as ``torch.argmax``): what :func:`sample_batch` returns when every row is greedy.

    On the CPU through NumPy, whose vectorised argmax is about ten times faster than torch's one-thread
    reduction over a vocabulary: on a small model the greedy pick was a third of the engine's host step.
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


@dataclass(frozen=True, slots=True)
class KeptDistribution:
    """What the sampler draws from, per row (R rows, V tokens, float64), tokens sorted by probability."""

    order: torch.Tensor  # int64 [R, V]: token ids, most likely first (stable: lower id first on ties)
    sorted_probs: torch.Tensor  # float64 [R, V]: their probabilities after top-k and softmax, 0 if cut
    cum: torch.Tensor  # float64 [R, V]: cumulative sum of sorted_probs (its last entry: the kept mass)

    def probabilities(self) -> torch.Tensor:
        """float64 [R, V] in token order: the chance of drawing each token (kept mass normalised to 1)."""
        probs = torch.zeros_like(self.sorted_probs)
        probs.scatter_(1, self.order, self.sorted_probs / self.cum[:, -1:])
        return probs


def kept_distribution(logits: torch.Tensor, params: Sequence[SamplingParams]) -> KeptDistribution:
    """Steps 1-3 of the module docstring's procedure on float64 rows ``[R, V]`` (temperature > 0)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64)
    x = logits / temperature[:, None]
    vocab = x.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params])
    if bool((top_k > 0).any()):
        # the k-th largest of each row: one topk of the largest k, then each row's own k
        kth = torch.topk(x, int(top_k.max()), dim=-1).values.gather(1, (top_k.clamp(min=1) - 1)[:, None])
        cut = (x < kth) & (top_k > 0)[:, None]
        x = x.masked_fill(cut, -math.inf)
    probs = torch.softmax(x, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(sorted_probs, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    if bool((top_p < 1.0).any()):
        # keep token j while the mass before it is still short of top_p (token 0 always kept)
        keep = ((cum - sorted_probs) < top_p[:, None]) | (top_p >= 1.0)[:, None]
        sorted_probs = sorted_probs * keep
        cum = torch.cumsum(sorted_probs, dim=-1)
    return KeptDistribution(order, sorted_probs, cum)
