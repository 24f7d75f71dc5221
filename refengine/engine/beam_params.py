"""What beam search takes and returns, shaped like vLLM's offline API: :class:`BeamSearchParams` in,
one :class:`BeamSearchOutput` per prompt out, its :class:`BeamSearchSequence` best first.

Kept apart from the search itself so that these records import no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedbench.refengine.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """How to search one batch of prompts (vLLM's names and meanings).

    Every beam generates at most ``max_tokens`` tokens. ``ignore_eos`` keeps EOS candidates as live
    beams (every beam then runs to ``max_tokens``). ``temperature`` > 0 divides the logits before the
    log-softmax that scores candidates; 0 scores the model's own log-probabilities. ``length_penalty``
    ranks the final sequences by ``cum_logprob / len(tokens) ** length_penalty`` (:func:`beam_score`).
    """

    beam_width: int  # beams kept per prompt (>= 1)
    max_tokens: int  # tokens each beam generates at most (>= 1)
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise InvalidArgumentError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if (not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool)
                or not math.isfinite(self.length_penalty)):
            raise InvalidArgumentError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass(frozen=True, slots=True)
class BeamSearchSequence:
    """One finished beam. ``tokens`` holds the prompt too (as vLLM's); ``logprobs`` has one entry per
    generated token (the log-probability the search scored it with); ``text`` decodes ``tokens`` when
    the model has a tokenizer. ``finish_reason``: "length" (``max_tokens``) or "eos" (its last token)."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float
    finish_reason: str
    text: str | None = None


@dataclass(frozen=True, slots=True)
class BeamSearchOutput:
    """The beams of one prompt, best first (by :func:`beam_score`), at most ``beam_width`` of them."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: frozenset[int],
               length_penalty: float) -> float:
    """vLLM's ranking of finished beams: ``cum_logprob / len ** length_penalty``, where ``len`` counts the
    prompt and every generated token but a final EOS."""
    n = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (n ** length_penalty)
