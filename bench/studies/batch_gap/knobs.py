"""The knobs of the decomposition: the serving study's Fig. 2/13 point as one frozen record, and the
rows that each change one field of it.

The default is the serving study's point (:mod:`.serving_point`, read from ``bench/configs/serving.yaml``):
its first setting (OPT-13B on an A100-40GB), the ShareGPT memory point (rate and scheduler policy), its
paged block size, ``max_num_seqs``, chunked-prefill budget, watermark, span and measured window. A
:class:`Cause` names one field of :class:`Knobs` and the value it takes; :func:`knobs_for` is the only
way a row's knobs are built, so a row differs from the default in that field alone
(:func:`changed_fields` says which fields two knob sets differ in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedbench.bench.studies.batch_gap.serving_point import ServingPoint


class BatchGapConfigError(ValueError):
    """A bad decomposition config: names the option and what is known."""


@dataclass(frozen=True, slots=True)
class Knobs:
    """Everything a decomposition run changes (the rest is the serving study's point as it is)."""

    max_num_seqs: int  # sequences running at most (vLLM's default 256)
    policy: str  # "separate" (prompt steps apart, the paper's vLLM v0.1) or "mixed" (chunked prefill)
    max_num_batched_tokens: int  # the chunked-prefill budget of a mixed step
    output_sigma: float | None  # the log-normal shape of output lengths (None: the dataset's own)
    block_size: int  # slots per paged block
    watermark: float  # share of the pool kept free at admission
    rate: float  # offered requests/s (Poisson)
    span_s: float  # simulated seconds of arrivals
    window: tuple[float, float]  # (warm-up share, cool-down share) of the span not measured
    cost_scale: tuple[tuple[str, float], ...] = ()  # (cost term, factor): the step-cost model scaled


FIELDS = tuple(f.name for f in dataclasses.fields(Knobs))


@dataclass(frozen=True, slots=True)
class Cause:
    """One row: ``field`` of the default knobs set to ``value``."""

    name: str
    field: str
    value: object
    why: str  # what the row stands for
    # whether the change describes the paper's run (its setting, or an assumption about it, stated in
    # ``why``): the combined run takes the rows marked so whose effect is above the seeds' noise
    paper: bool = False


def default_knobs(point: ServingPoint) -> Knobs:
    """The serving study's Fig. 2/13 point as :class:`Knobs`."""
    return Knobs(max_num_seqs=point.max_num_seqs, policy=point.policy,
                 max_num_batched_tokens=point.max_num_batched_tokens, output_sigma=None,
                 block_size=point.block_size, watermark=point.watermark, rate=point.rate, span_s=point.span_s,
                 window=(point.warmup_frac, point.cooldown_frac))


def _normalized(field: str, value: object) -> object:
    """A YAML value in the field's type (lists as tuples, so knobs stay hashable and comparable)."""
    if field == "window":
        return tuple(float(v) for v in value)
    if field == "cost_scale":
        return tuple((str(t), float(f)) for t, f in value)
    return value


def knobs_for(default: Knobs, cause: Cause) -> Knobs:
    """The default knobs with ``cause.field`` set to ``cause.value`` (and nothing else)."""
    if cause.field not in FIELDS:
        raise BatchGapConfigError(f"cause {cause.name!r}: unknown knob {cause.field!r}; known: {', '.join(FIELDS)}")
    knobs = dataclasses.replace(default, **{cause.field: _normalized(cause.field, cause.value)})
    if knobs == default:
        raise BatchGapConfigError(f"cause {cause.name!r}: {cause.field} = {cause.value!r} is the default's value")
    return knobs


def combined(default: Knobs, causes: list[Cause]) -> Knobs:
    """The default knobs with every cause of ``causes`` applied (one per field)."""
    fields = [c.field for c in causes]
    if len(set(fields)) != len(fields):
        raise BatchGapConfigError(f"the combined run changes a field twice: {fields}")
    return dataclasses.replace(default, **{c.field: _normalized(c.field, c.value) for c in causes})


def changed_fields(a: Knobs, b: Knobs) -> tuple[str, ...]:
    """The fields in which ``a`` and ``b`` differ, in declaration order."""
    return tuple(f for f in FIELDS if getattr(a, f) != getattr(b, f))
