"""The serving study's config (``bench/configs/serving.yaml``): settings, datasets, the method's knobs.

Every value is checked when the file is read, before anything runs or is written: an unknown key,
GPU, model, dataset or SLO preset, a ``max_seq_len`` above the model's context, a span that is not a
positive number of seconds, each names the file, the option and (where there is a list) the known names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from pagedbench.bench import workloads
from pagedbench.bench.common.slo import PRESETS, SLOError, parse_slo
from pagedbench.bench.costmodel import ProfileError, StepCostModel, kv_slot_budget, load_hardware, load_model
from pagedbench.bench.costmodel.hardware import hardware_names
from pagedbench.bench.costmodel.models import model_names
from pagedbench.bench.sim.records import AllocatorSpec
from pagedbench.bench.sim.settings import Dataset, Setting
from pagedbench.bench.workloads import trace_formats

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "serving.yaml"
_KEYS = {"settings", "linear_model", "datasets", "allocators", "policies", "policy_comparison_settings", "max_num_seqs",
         "max_num_batched_tokens", "watermark", "gpu_memory_utilization", "thresholds", "low_load_requests",
         "bisection_steps", "seeds", "memory_points", "workers", "span_s", "warmup_frac", "cooldown_frac",
         "overload_z", "slos", "sensitivity", "full", "capacity_resolution", "min_window_arrivals",
         "target_half_width", "max_seeds", "precision_settings"}


class ServingConfigError(ValueError):
    """A bad serving config: names the file, the option, and what is known."""


@dataclass(frozen=True, slots=True)
class Sensitivity:
    setting: str
    dataset: str
    policy: str
    factors: tuple[float, ...]  # each term is scaled by each factor
    terms: tuple[str, ...]  # "step_overhead", "attention"


@dataclass(frozen=True, slots=True)
class StudyConfig:
    settings: tuple[Setting, ...]
    datasets: tuple[Dataset, ...]
    allocators: tuple[AllocatorSpec, ...]
    policies: tuple[str, ...]  # the first is every setting's default (the headline)
    policy_comparison_settings: tuple[str, ...]
    max_num_seqs: int
    max_num_batched_tokens: int  # the chunked-prefill token budget of a step (its own setting)
    watermark: float
    gpu_memory_utilization: float
    thresholds: tuple[float, ...]
    low_load_requests: int
    bisection_steps: int
    seeds: tuple[int, ...]
    memory_points: tuple[tuple[str, float, str], ...]  # (dataset, rate, policy) on the first setting
    workers: int
    span_s: float
    warmup_frac: float
    cooldown_frac: float
    overload_z: float
    slos: tuple[str, ...]
    sensitivity: Sensitivity | None
    # precision: each search bisects until its bracket is within this factor (None: bisection_steps)
    capacity_resolution: float | None = None
    min_window_arrivals: int = 0  # a point's span grows until its measured window expects this many
    target_half_width: float = 0.05  # replicates are added until every headline interval is within +-this
    max_seeds: int = 0  # the most replicates a group gets (0: just ``seeds``)
    precision_settings: tuple[str, ...] | None = None  # the settings replicates are added for (None: all)

    def max_seq_len(self, setting: Setting, dataset: Dataset | None = None) -> int:
        if dataset is not None and dataset.max_seq_len:
            return dataset.max_seq_len
        return setting.max_seq_len or load_model(setting.model).max_position_embeddings

    def span(self, setting: Setting, dataset: Dataset) -> float:
        return dataset.span_s or setting.span_s or self.span_s

    def policies_for(self, setting: Setting, dataset: Dataset) -> tuple[str, ...]:
        if dataset.policies is not None:
            return dataset.policies
        return self.policies if setting.name in self.policy_comparison_settings else self.policies[:1]


def _positive_span(path: Path, where: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ServingConfigError(f"{path}: {where}: span_s must be a positive number of seconds, got {value!r}")


def _check(path: Path, cfg: StudyConfig) -> None:
    _positive_span(path, "span_s", cfg.span_s)
    for s in cfg.settings:
        try:
            model = load_model(s.model)
        except ProfileError:
            raise ServingConfigError(f"{path}: setting {s.name!r}: unknown model profile {s.model!r}; known: "
                                     f"{', '.join(model_names())}") from None
        try:
            hardware = load_hardware(s.hardware)
        except ProfileError:
            raise ServingConfigError(f"{path}: setting {s.name!r}: unknown GPU profile {s.hardware!r}; known: "
                                     f"{', '.join(hardware_names())}") from None
        _positive_span(path, f"setting {s.name!r}", s.span_s)
        try:  # a tensor_parallel_size the heads do not divide, or with no all-reduce data, is refused here
            slots = kv_slot_budget(model, hardware, cfg.gpu_memory_utilization,
                                   tensor_parallel_size=s.tensor_parallel_size).num_slots
            StepCostModel.from_profiles(model, hardware, tensor_parallel_size=s.tensor_parallel_size)
        except ValueError as e:
            raise ServingConfigError(f"{path}: setting {s.name!r}: {e}") from None
        for d in (d for d in cfg.datasets if d.runs_on(s)):
            msl = cfg.max_seq_len(s, d)
            if msl > model.max_position_embeddings or msl < 2:
                raise ServingConfigError(
                    f"{path}: setting {s.name!r}, dataset {d.name!r}: max_seq_len {msl} must be in "
                    f"[2, {model.max_position_embeddings}] (the context of {s.model})")
            if msl > slots:  # as vLLM refuses a max_model_len its KV cache cannot hold
                raise ServingConfigError(
                    f"{path}: setting {s.name!r}, dataset {d.name!r}: max_seq_len {msl} exceeds the "
                    f"{slots} KV slots of {s.model} on {s.hardware}; set a smaller max_seq_len")
    names = {s.name for s in cfg.settings}
    for d in cfg.datasets:
        if bool(d.dataset) == bool(d.trace):
            raise ServingConfigError(f"{path}: dataset {d.name!r}: give either dataset or trace, not "
                                     f"{'both' if d.dataset else 'neither'}")
        if d.dataset and d.dataset not in workloads.DATASETS:
            raise ServingConfigError(f"{path}: dataset {d.name!r}: unknown dataset {d.dataset!r}; known: "
                                     f"{', '.join(workloads.DATASETS)}")
        if d.trace and not (d.trace in trace_formats.SHIPPED or Path(d.trace).is_file()):
            raise ServingConfigError(f"{path}: dataset {d.name!r}: trace {d.trace!r} is neither a shipped trace "
                                     f"({', '.join(trace_formats.SHIPPED)}) nor a file")
        if d.trace and (d.over_context not in ("drop", "clip") or d.shared_prefix_len):
            raise ServingConfigError(f"{path}: dataset {d.name!r}: a trace takes over_context drop or clip (got "
                                     f"{d.over_context!r}) and no shared_prefix_len (its prompts are its own)")
        _positive_span(path, f"dataset {d.name!r}", d.span_s)
        if d.settings and set(d.settings) - names:
            raise ServingConfigError(f"{path}: dataset {d.name!r}: unknown settings "
                                     f"{sorted(set(d.settings) - names)}; known: {sorted(names)}")
    for name in cfg.slos:
        try:
            parse_slo(name)
        except SLOError as e:
            raise ServingConfigError(f"{path}: slos: {e}") from None
    if any(t <= 1 for t in cfg.thresholds) or cfg.bisection_steps < 0 or cfg.workers < 1 or not cfg.seeds:
        raise ServingConfigError(f"{path}: thresholds must be > 1, bisection_steps >= 0, workers >= 1, seeds "
                                 "not empty")
    if not (cfg.warmup_frac >= 0 and cfg.cooldown_frac >= 0 and cfg.warmup_frac + cfg.cooldown_frac < 1):
        raise ServingConfigError(f"{path}: warmup_frac and cooldown_frac must be >= 0 with a sum < 1")
    datasets = {d.name for d in cfg.datasets}
    for ds, _, policy in cfg.memory_points:
        if ds not in datasets or policy not in cfg.policies:
            raise ServingConfigError(f"{path}: memory_points: dataset {ds!r} / policy {policy!r}; known: "
                                     f"{sorted(datasets)} / {list(cfg.policies)}")
    sens = cfg.sensitivity
    if sens and (sens.setting not in names or sens.dataset not in datasets or sens.policy not in cfg.policies
                 or set(sens.terms) - {"step_overhead", "attention"} or any(f <= 0 for f in sens.factors)):
        raise ServingConfigError(f"{path}: sensitivity: setting {sens.setting!r} (known: {sorted(names)}), dataset "
                                 f"{sens.dataset!r} (known: {sorted(datasets)}), policy {sens.policy!r}, terms "
                                 f"{list(sens.terms)} (known: step_overhead, attention), factors > 0")
    if cfg.capacity_resolution is not None and not 0 < cfg.capacity_resolution < 1:
        raise ServingConfigError(f"{path}: capacity_resolution must be in (0, 1), got {cfg.capacity_resolution}")
    if not 0 < cfg.target_half_width < 1 or cfg.min_window_arrivals < 0 or cfg.max_seeds < 0:
        raise ServingConfigError(f"{path}: target_half_width must be in (0, 1), min_window_arrivals and "
                                 "max_seeds >= 0")
    if cfg.precision_settings and set(cfg.precision_settings) - names:
        raise ServingConfigError(f"{path}: precision_settings: unknown settings "
                                 f"{sorted(set(cfg.precision_settings) - names)}; known: {sorted(names)}")
    if cfg.max_num_batched_tokens < 1 or cfg.overload_z <= 0:
        raise ServingConfigError(f"{path}: max_num_batched_tokens must be >= 1 and overload_z > 0")


def load_config(path: str | Path = CONFIG, *, full: bool = False) -> StudyConfig:
    """The study's config; any bad value raises :class:`ServingConfigError` (module docstring)."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict):
        raise ServingConfigError(f"{path}: expected a mapping at the top level")
    unknown = set(doc) - _KEYS
    if unknown:
        raise ServingConfigError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(_KEYS)}")
    if full:
        doc = {**doc, **(doc.get("full") or {})}
    try:
        sens = doc.get("sensitivity")
        cfg = StudyConfig(
            # a study-wide linear_model is every setting's unless the setting names its own
            settings=tuple(Setting(**{"linear_model": doc.get("linear_model", "roofline"), **s})
                           for s in doc["settings"]),
            datasets=tuple(Dataset(**{**d, **{k: tuple(d[k]) for k in ("settings", "kinds", "policies")
                                                if d.get(k)}}) for d in doc["datasets"]),
            allocators=tuple(AllocatorSpec(**a) for a in doc["allocators"]),
            policies=tuple(doc["policies"]),
            policy_comparison_settings=tuple(doc["policy_comparison_settings"]),
            max_num_seqs=int(doc["max_num_seqs"]), max_num_batched_tokens=int(doc["max_num_batched_tokens"]),
            watermark=float(doc["watermark"]), gpu_memory_utilization=float(doc["gpu_memory_utilization"]),
            thresholds=tuple(float(t) for t in doc["thresholds"]),
            low_load_requests=int(doc["low_load_requests"]), bisection_steps=int(doc["bisection_steps"]),
            seeds=tuple(int(s) for s in doc["seeds"]),
            memory_points=tuple((m["dataset"], float(m["rate"]), m.get("policy", "separate"))
                                for m in doc["memory_points"]),
            workers=int(doc["workers"]), span_s=doc["span_s"], warmup_frac=float(doc["warmup_frac"]),
            cooldown_frac=float(doc["cooldown_frac"]), overload_z=float(doc["overload_z"]),
            slos=tuple(doc.get("slos") or ()),
            sensitivity=Sensitivity(sens["setting"], sens["dataset"], sens["policy"],
                                    tuple(float(f) for f in sens["factors"]), tuple(sens["terms"]))
            if sens else None,
            capacity_resolution=(None if doc.get("capacity_resolution") is None
                                 else float(doc["capacity_resolution"])),
            min_window_arrivals=int(doc.get("min_window_arrivals", 0)),
            target_half_width=float(doc.get("target_half_width", 0.05)),
            max_seeds=int(doc.get("max_seeds", 0)),
            precision_settings=(tuple(doc["precision_settings"]) if doc.get("precision_settings") is not None
                                else None))
    except KeyError as e:
        raise ServingConfigError(f"{path}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ServingConfigError(f"{path}: {e}") from None
    _check(path, cfg)
    return cfg


__all__ = ["CONFIG", "PRESETS", "Dataset", "Sensitivity", "ServingConfigError", "Setting", "StudyConfig",
           "load_config"]
