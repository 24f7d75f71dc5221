"""Token prompts for the real engine: a dataset's length distribution, scaled, with random token ids.

:func:`make_trace` turns a :class:`Workload` (a dataset of :data:`~pagedbench.bench.workloads.DATASETS`,
its lengths scaled for a CPU, a request count, an optional system prompt every request shares) into a
:class:`Trace` of prompts and output lengths that fit a model's context. The throughput study serves
them; the calibration serves the same kind of trace on the engine and on the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pagedbench.bench.workloads.datasets import synthetic


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    dataset: str  # "sharegpt" or "alpaca" (bench.workloads.DATASETS)
    length_scale: float  # prompt and output lengths multiplied by this (CPU: shorter than the paper's)
    num_requests: int
    system_prompt_len: int = 0  # tokens of a system prompt shared by every request (0: none)


@dataclass(frozen=True, slots=True)
class Trace:
    prompts: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    @property
    def mean_prompt_len(self) -> float:
        return float(np.mean([len(p) for p in self.prompts]))

    @property
    def mean_output_len(self) -> float:
        return float(np.mean(self.output_lens))


def make_trace(w: Workload, *, vocab_size: int, max_model_len: int, seed: int) -> Trace:
    """Token prompts with the workload's scaled lengths; every request fits ``max_model_len``."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, w.system_prompt_len).tolist()
    prompts, outputs = [], []
    for r in synthetic(w.dataset, w.num_requests, seed=seed):
        p = int(np.clip(round(r.prompt_len * w.length_scale), 1, max_model_len - 1 - len(system)))
        o = int(np.clip(round(r.output_len * w.length_scale), 1, max_model_len - p - len(system)))
        prompts.append(tuple(system + rng.integers(0, vocab_size, p).tolist()))
        outputs.append(o)
    return Trace(tuple(prompts), tuple(outputs))


