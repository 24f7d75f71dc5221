"""What a serving point runs on: a :class:`Setting` (a model on a GPU, its context and span) and a
:class:`Dataset` (a synthetic length distribution or a request trace, and how it is served). The serving
study's config file lists them (:mod:`pagedbench.bench.studies.serving.config` reads and checks it); the
simulator's points, the Fig. 14 study and ``serve-sim`` build them directly.

A setting's ``linear_model`` (``roofline``, the default, or ``tile``) picks how its step cost prices the
linear layers (:meth:`pagedbench.bench.costmodel.step_cost.StepCostModel.from_profiles`' ``linear``); in
the serving config it is one more key of a setting (``linear_model: tile``); any other value is refused
when the setting is made, naming the choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedbench.bench.costmodel.step_cost import LINEAR_MODELS


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    model: str
    hardware: str
    max_seq_len: int | None = None  # None: the model's context (max_position_embeddings)
    span_s: float | None = None  # simulated seconds of arrivals per point (None: the study's span_s)
    note: str = ""  # why this setting is in the study (shown in the report)
    # GPUs the model is sharded over (Megatron-style): the cost model's per-GPU work and all-reduces, the KV
    # slots of one GPU's share (every GPU holds its heads' K/V for every token), the price of all of them
    tensor_parallel_size: int = 1
    # how the cost model prices the linear layers (StepCostModel.from_profiles' ``linear``): "roofline",
    # one max(memory, compute) in the step's token count, or "tile", the GPU's tile fit on Vidur's
    # profiles, which follows the GEMMs' steps at each multiple of their row tile
    linear_model: str = "roofline"

    def __post_init__(self) -> None:
        if self.linear_model not in LINEAR_MODELS:
            raise ValueError(f"setting {self.name!r}: linear_model={self.linear_model!r}; expected one of "
                             f"{', '.join(map(repr, LINEAR_MODELS))}")


@dataclass(frozen=True, slots=True)
class Dataset:
    name: str
    dataset: str = ""  # a synthetic dataset (workloads.DATASETS), or
    trace: str = ""  # a request trace: a shipped trace's name or a file (bench/workloads/trace_spans.py replays it)
    over_context: str = "drop"  # a trace's requests past max_seq_len: drop or clip (never error mid-study)
    shared_prefix_len: int = 0  # tokens of a system prompt every request starts with
    prefix_caching: bool = False  # the paged manager's prefix cache (Orca cannot share)
    max_seq_len: int | None = None  # overrides the setting's (checked against the model's context too)
    settings: tuple[str, ...] | None = None  # the settings it runs on (None: all)
    kinds: tuple[str, ...] | None = None  # the KV manager kinds it runs with (None: all)
    policies: tuple[str, ...] | None = None  # the scheduler policies it runs with (None: the comparison rule)
    span_s: float | None = None  # overrides the setting's span
    # or a named workload with token ids of its own (bench.workloads.sessions.WORKLOADS: few-shot prefixes,
    # chatbot rounds), in place of dataset and trace
    workload: str = ""

    def runs_on(self, setting: Setting) -> bool:
        return self.settings is None or setting.name in self.settings
