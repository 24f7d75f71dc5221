"""Fit a :class:`StepCostModel` to measured steps (e.g. the engine's steps timed on a CPU).

A CPU has no separate bandwidth roof worth modelling for our sizes, so the fit keeps the compute side
of the roofline, which is linear in five terms of a batch::

    seconds ~ fixed_s                                  x 1            (per non-empty step)
            + linear_compute_s_per_token               x num_tokens   (every token through every layer)
            + lm_head_s_per_sampled_token              x num_sampled  (decode sequences + prefill chunks)
            + decode_attn_s_per_context_token          x sum of decode context lengths
            + prefill_attn_s_per_pair                  x sum over chunks of q * (ctx + (q + 1) / 2)

Least squares on relative error (step times span orders of magnitude), with every coefficient kept
>= 0 by dropping a negative term and refitting. A term the samples never exercise (no prefill at all,
say) comes back 0. The memory-side coefficients of the returned model are 0, so its step time is
exactly this sum.

:func:`fit_batched_profile` fits the same way the nine terms of the CPU default backend
(:mod:`bench.costmodel.batched_cost`: the five above plus its attention groups, their padding and the prefill
group's own work).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pagedbench.bench.costmodel.batched_cost import BATCHED_TERMS, BatchedStepCost, batched_term_row
from pagedbench.bench.costmodel.step_cost import StepBatch, StepCostModel

TERMS = ("fixed_s", "linear_compute_s_per_token", "lm_head_s_per_sampled_token",
         "decode_attn_s_per_context_token", "prefill_attn_s_per_pair")


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: what ran and how long it took."""

    batch: StepBatch
    seconds: float


def term_row(batch: StepBatch) -> list[float]:
    """The batch's value of each of :data:`TERMS` (the design-matrix row)."""
    num_decode = len(batch.decode_context_lens)
    pairs = sum(q * (ctx + 0.5 * (q + 1)) for q, ctx in batch.prefill_chunks)
    return [1.0, float(batch.num_tokens), float(num_decode + len(batch.prefill_chunks)),
            float(sum(batch.decode_context_lens)), float(pairs)]


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            break
        # A negative cost is unphysical (collinear or unexercised terms): drop the most negative, refit.
        del active[int(sol.argmin())]
    return x


def _fit(samples: Sequence[StepSample], terms: tuple[str, ...], row) -> tuple[dict[str, float], float]:
    """Non-negative least squares on relative error: the coefficients by term, and the rms relative error."""
    if len(samples) < len(terms):
        raise ValueError(f"need at least {len(terms)} samples to fit {len(terms)} terms, got {len(samples)}")
    bad = [s.seconds for s in samples if not s.seconds > 0]
    if bad:
        raise ValueError(f"every sample needs seconds > 0, got {bad[:3]}")
    if any(s.batch.num_tokens == 0 for s in samples):
        raise ValueError("a sample with an empty batch cannot be fitted (an empty step costs 0 by "
                         "definition)")
    rows = np.array([row(s.batch) for s in samples])
    seconds = np.array([s.seconds for s in samples])
    # Columns scaled to unit norm first: the terms span ~10 orders of magnitude (1 vs key x query counts)
    a = rows / seconds[:, None]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    coef = _nonnegative_lstsq(a / norms, np.ones(len(samples))) / norms  # rows / y . x ~ 1
    rms = float(np.sqrt(np.mean((rows @ coef / seconds - 1.0) ** 2)))
    return dict(zip(terms, map(float, coef))), rms


def term_identifiability(samples: Sequence[StepSample], terms: tuple[str, ...] = BATCHED_TERMS,
                         row=batched_term_row) -> dict[str, float]:
    """How well ``samples`` tell each term apart from the others: the share (0..1) of the term's column of
    the fit's design matrix (relative weighting, unit-norm columns) that no combination of the other
    columns explains, ``sqrt(1 - R^2)`` of regressing it on them. 0: the term moves with the others over
    these samples (or is never exercised), so its fitted value is arbitrary; near 1: independent."""
    rows = np.array([row(s.batch) for s in samples], dtype=np.float64)
    a = rows / np.array([s.seconds for s in samples])[:, None]
    norms = np.linalg.norm(a, axis=0)
    out = {}
    for j, term in enumerate(terms):
        if norms[j] == 0:
            out[term] = 0.0
            continue
        others = np.delete(a / np.where(norms == 0, 1.0, norms), j, axis=1)
        col = a[:, j] / norms[j]
        sol, *_ = np.linalg.lstsq(others, col, rcond=None)
        out[term] = float(np.linalg.norm(col - others @ sol))
    return out


def fit_profile(samples: Sequence[StepSample], label: str | None = None) -> StepCostModel:
    """The :class:`StepCostModel` whose step times best match ``samples`` (relative least squares)."""
    fitted, rms = _fit(samples, TERMS, term_row)
    return StepCostModel(
        label=label or f"fit to {len(samples)} measured steps (rms relative error {rms:.1%})",
        linear_weights_s=0.0, linear_mem_s_per_token=0.0, prefill_attn_s_per_kv_token=0.0, **fitted)


def fit_batched_profile(samples: Sequence[StepSample], label: str | None = None) -> BatchedStepCost:
    """The :class:`BatchedStepCost` whose step times best match ``samples`` (relative least squares)."""
    fitted, rms = _fit(samples, BATCHED_TERMS, batched_term_row)
    return BatchedStepCost(label=label or f"fit to {len(samples)} measured steps (rms relative error {rms:.1%})",
                           **fitted)


def terms_of(cost: StepCostModel | BatchedStepCost) -> tuple[str, ...]:
    """The fitted terms of ``cost``: :data:`BATCHED_TERMS` or :data:`TERMS`."""
    return BATCHED_TERMS if isinstance(cost, BatchedStepCost) else TERMS


def relative_errors(cost: StepCostModel | BatchedStepCost, samples: Sequence[StepSample]) -> np.ndarray:
    """predicted / measured - 1 for each sample."""
    return np.array([cost.step_time_s(s.batch) / s.seconds - 1.0 for s in samples])


# -- which machine a fit belongs to ---------------------------------------------------------------------------
# A CPU fit prices one machine's steps: another CPU model (or core count) runs the same shapes at other
# speeds, so a fit published from one machine is no model of another. A calibration record names its machine,
# and a check that runs elsewhere refits first.


@dataclass(frozen=True, slots=True)
class CalibrationMachine:
    """The CPU a calibration was measured on: its model name and the cores the process could see."""

    cpu_model: str
    cpu_count: int | None

    def to_record(self) -> dict:
        return {"cpu_model": self.cpu_model, "cpu_count": self.cpu_count}

    @classmethod
    def from_record(cls, record: dict | None) -> CalibrationMachine | None:
        """The machine a calibration record names: its ``calibration.machine``, or (a record from before it
        was kept there) its environment's ``machine``; None when it names neither."""
        if not isinstance(record, dict):
            return None
        own = (record.get("calibration") or {}).get("machine")
        if isinstance(own, dict) and own.get("cpu_model"):
            return cls(str(own["cpu_model"]), own.get("cpu_count"))
        env = (record.get("environment") or {}).get("machine")
        if isinstance(env, dict) and env.get("cpu"):
            return cls(str(env["cpu"]), env.get("cpu_count"))
        return None


def cpu_model_name() -> str:
    """This CPU's model name: /proc/cpuinfo's ``model name``, else py-cpuinfo's brand when it is installed,
    else what :mod:`platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        import cpuinfo  # py-cpuinfo, optional

        brand = cpuinfo.get_cpu_info().get("brand_raw")
        if brand:
            return str(brand)
    except Exception:  # not installed, or it could not read this CPU: fall through to platform
        pass
    return platform.processor() or platform.machine()


def this_machine() -> CalibrationMachine:
    """The CPU this process runs on (:func:`cpu_model_name`, ``os.cpu_count()``)."""
    return CalibrationMachine(cpu_model_name(), os.cpu_count())


@dataclass(frozen=True, slots=True)
class FitChoice:
    """Whether a check may use a published fit here, or must refit first, and why."""

    refit: bool
    reason: str
    published: CalibrationMachine | None
    here: CalibrationMachine

    def to_record(self) -> dict:
        return {"refit": self.refit, "reason": self.reason,
                "published_machine": None if self.published is None else self.published.to_record(),
                "this_machine": self.here.to_record()}


def choose_fit(published: CalibrationMachine | None, here: CalibrationMachine) -> FitChoice:
    """Refit when the published fit's machine is unknown or differs from ``here`` in CPU model or core count."""
    if published is None:
        return FitChoice(True, "the published calibration names no CPU, so it may be another machine's", None, here)
    if published.cpu_model != here.cpu_model:
        return FitChoice(True, f"the published fit was measured on {published.cpu_model!r}, this machine is "
                               f"{here.cpu_model!r}", published, here)
    if published.cpu_count != here.cpu_count:
        return FitChoice(True, f"the published fit was measured with {published.cpu_count} cores, this machine "
                               f"has {here.cpu_count}", published, here)
    return FitChoice(False, f"the published fit was measured on this CPU ({here.cpu_model!r}, {here.cpu_count} "
                            "cores)", published, here)
