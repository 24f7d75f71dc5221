"""What a request asks of the sampler: :class:`SamplingParams` (vLLM's offline-API names) and the
seed a request given ``seed=None`` derives from the engine's seed.

Kept apart from the sampler itself (``refengine.model.sampling``) so that the scheduler and the
sequences, which carry these parameters, import no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedbench.refengine.errors import InvalidArgumentError

_SEED_MODULUS = 2**62  # keeps derived seeds (and seed + child index) inside torch's int64 seed range


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request (vLLM's offline-API names and meanings).

    ``stop_token_ids`` and the model's EOS ids end a sequence *with* the token included in its output
    (as Hugging Face's ``generate``); ``ignore_eos`` keeps going past EOS until ``max_tokens``. ``stop``
    strings end it where its text first holds one (the text cut there, the tokens kept).
    """

    max_tokens: int = 16  # tokens to generate at most (>= 1)
    temperature: float = 0.0  # 0 = greedy; > 0 scales logits by 1/temperature
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 keeps every token
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    n: int = 1  # completions per prompt (parallel sampling; children share the prompt's blocks)
    seed: int | None = None  # child i uses seed + i; None derives one from the engine's seed
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a sequence (included in its output)
    ignore_eos: bool = False  # do not stop at the model's EOS token(s)
    # EOS and stop_token_ids end no sequence before it has this many output tokens (vLLM masks those
    # tokens out until then; here they may be generated and are kept, but do not end it). A load
    # generator replaying a trace's lengths sets min_tokens = max_tokens
    min_tokens: int = 0
    # per generated token, the log-probabilities of the sampled token and of the k most likely ones
    # (the model's raw distribution, before temperature/top-k/top-p, as vLLM v1); None: none returned
    logprobs: int | None = None
    # vLLM's penalties on the logits before temperature/top-k/top-p (``refengine.model.penalties``):
    # presence and frequency count the generated tokens only, repetition the prompt's too
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from every generated token's logit
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence of a generated token
    repetition_penalty: float = 1.0  # > 0: a seen token's logit > 0 divided by it, <= 0 multiplied
    # strings that end a completion where its text first contains one (``engine/stop_strings.py``; needs
    # the model's tokenizer); the text is cut before it unless include_stop_str_in_output. A str is one stop
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # temperature == 0: argmax, no draw. Derived, not an argument; an attribute rather than a property
    # because the sampler reads it for every sequence of every step
    greedy: bool = field(init=False, repr=False, compare=False)
    # some penalty differs from its no-op default: only then does the sampler look at token histories
    penalized: bool = field(init=False, repr=False, compare=False)

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
        stops = (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(stops, bytes) or not hasattr(stops, "__iter__"):
            raise InvalidArgumentError(f"stop must be a str or a sequence of str, got {type(self.stop).__name__}")
        stops = tuple(stops)
        bad = [x for x in stops if not isinstance(x, str) or not x]
        if bad:
            raise InvalidArgumentError(f"stop strings must be non-empty str, got {bad!r}")
        object.__setattr__(self, "stop", stops)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidArgumentError(
                f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgumentError(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise InvalidArgumentError(
                f"logprobs must be None or an int >= 0 (the number of top tokens), got {self.logprobs!r}")
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if not _is_number(value) or not low <= value <= high:
                raise InvalidArgumentError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise InvalidArgumentError(f"repetition_penalty must be a finite number > 0, got "
                                       f"{self.repetition_penalty!r}")
        object.__setattr__(self, "greedy", self.temperature == 0)
        object.__setattr__(self, "penalized", self.presence_penalty != 0 or self.frequency_penalty != 0
                           or self.repetition_penalty != 1)


def derive_seed(engine_seed: int, request_id: int) -> int:
    """The base seed of a request given ``seed=None``: a fixed mix of the engine seed and request id."""
    return (engine_seed * 0x9E3779B97F4A7C15 + request_id * 0xBF58476D1CE4E5B9 + 1) % _SEED_MODULUS
