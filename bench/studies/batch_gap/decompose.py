"""The decomposition's arithmetic: each row's means over seeds and its paired deltas from the default,
whether a delta is above the seeds' noise, which rows the combined run takes, and the gap left.

Every row runs the same seeds as the default (the same arrivals per seed), so a row's delta is the mean
of per-seed differences and its standard error is theirs (``stdev / sqrt(n)``). A row *matters* when a
headline figure (mean batch, token-state share of the pool or of the held memory) moves by more than
``noise_z`` standard errors *and* by at least :data:`MIN_EFFECT` (a shift the seeds resolve but no reader
would call a cause, such as +0.1 point of a share whose seeds agree to 0.01, is not one).
"""

from __future__ import annotations

import math
import statistics

from pagedbench.bench.studies.batch_gap.knobs import Cause

#: the figures the decomposition reports, each against the paper's
FIGURES = ("mean_batch", "token_of_pool", "token_of_held")
#: the vLLM paper's figures for paged vLLM, OPT-13B on ShareGPT at 2 req/s (Fig. 13 and Fig. 2)
PAPER = {"mean_batch": 30.42, "token_of_pool": 0.963, "token_of_held": 0.963}
#: the smallest move that counts as an effect: 2% of the default's mean batch, half a point of a share
MIN_EFFECT = {"mean_batch": 0.02, "token_of_pool": 0.005, "token_of_held": 0.005}
#: the other means a row records (context for the figures)
_ALSO = ("achieved_rate", "mean_output_len", "mean_step_ms", "mean_batch_time_weighted", "free_of_pool",
         "num_preemptions", "peak_running")
PAPER_RATE_RPS, PAPER_MEAN_OUTPUT = 2.0, 337.99  # the paper's rate and ShareGPT mean output (§6.1)


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def paired_delta(default: list[dict], row: list[dict], key: str) -> tuple[float, float]:
    """(mean, standard error) of ``row - default`` over the seeds both ran."""
    base = {r["seed"]: r[key] for r in default}
    diffs = [r[key] - base[r["seed"]] for r in row if r["seed"] in base]
    if not diffs:
        raise ValueError(f"no seed in common between the default and the row ({key})")
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return statistics.fmean(diffs), se


def summarize(name: str, default: list[dict], rows: list[dict], noise_z: float) -> dict:
    """One table row: means, paired deltas (with errors), whether it matters, the overload count."""
    out = {"name": name, "num_seeds": len(rows), "num_overloaded": sum(bool(r["overloaded"]) for r in rows),
           "mean": {k: mean_of(rows, k) for k in (*FIGURES, *_ALSO)},
           "delta": {}, "matters": False}
    for k in FIGURES:
        d, se = paired_delta(default, rows, k)
        floor = MIN_EFFECT[k] * (mean_of(default, k) if k == "mean_batch" else 1.0)
        big = abs(d) > noise_z * se and abs(d) >= floor
        out["delta"][k] = {"mean": d, "standard_error": se, "above_noise": big}
        out["matters"] |= big
    return out


def to_combine(causes: list[Cause], summaries: dict[str, dict]) -> list[Cause]:
    """The causes the combined run applies: those marked as the paper's whose row mattered."""
    return [c for c in causes if c.paper and summaries[c.name]["matters"]]


def per_token_ms(mean_batch: float, rate: float, mean_output: float) -> float:
    """Little's law read backwards: the mean batch is the rate requests leave times the time each spends
    running, so ``batch / (rate x output tokens)`` is the time one output token keeps a request in the
    batch (its step time, plus its share of prompt steps and preempted time)."""
    return 1e3 * mean_batch / (rate * mean_output)


def left_unexplained(combined: dict) -> dict:
    """The paper's figure minus the combined run's, per figure."""
    return {k: PAPER[k] - combined["mean"][k] for k in FIGURES}
