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
from dataclasses import dataclass

import torch

from refengine.errors import InvalidArgumentError

_SEED_MODULUS = 2**62  # keeps derived seeds (and seed + child index) inside torch's int64 seed range


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request (vLLM's offline-API names and meanings).

    ``stop_token_ids`` and the model's EOS ids end a sequence *with* the token included in its output
    (as Hugging Face's ``generate``); ``ignore_eos`` keeps going past EOS until ``max_tokens``.
    """

    max_tokens: int = 16  # tokens to generate at most (>= 1)
    temperature: float = 0.0  # 0 = greedy; > 0 scales logits by 1/temperature
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 keeps every token
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    n: int = 1  # completions per prompt (parallel sampling; children share the prompt's blocks)
    seed: int | None = None  # child i uses seed + i; None derives one from the engine's seed
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a sequence (included in its output)
    ignore_eos: bool = False  # do not stop at the model's EOS token(s)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if (not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool)
                or not 0.0 < self.top_p <= 1.0):
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an int >= 0 (0 = disabled), got {self.top_k!r}")
        if not _is_int(self.n) or self.n < 1:
            raise InvalidArgumentError(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _SEED_MODULUS):
            raise InvalidArgumentError(f"seed must be None or an int in [0, 2**62), got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise InvalidArgumentError(
                f"stop_token_ids must be a sequence of ints, got {type(self.stop_token_ids).__name__}")
        stop = tuple(self.stop_token_ids)
        bad = [t for t in stop if not _is_int(t) or t < 0]
        if bad:
            raise InvalidArgumentError(f"stop_token_ids must be non-negative ints, got {bad!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def derive_seed(engine_seed: int, request_id: int) -> int:
    """The base seed of a request given ``seed=None``: a fixed mix of the engine seed and request id."""
    return (engine_seed * 0x9E3779B97F4A7C15 + request_id * 0xBF58476D1CE4E5B9 + 1) % _SEED_MODULUS


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
