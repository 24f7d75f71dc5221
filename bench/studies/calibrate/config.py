"""The calibration study's config (``bench/configs/calibrate.yaml``), read strictly.

Three sections, ``engine``, ``grid`` and ``validation``, each a frozen dataclass; ``quick`` holds
replacements for any of their fields (``--quick``). Every field is required; an unknown or missing
field, a wrong type, a size < 1 or a grid the engine cannot serve raises :class:`ProfileError` (a
``ValueError``) naming the file, the field (``grid.decode_batches``; ``quick.grid.decode_batches`` when
the quick section set it) and its line.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pagedbench.bench.costmodel import ProfileError
from pagedbench.bench.workloads import DATASETS
from pagedbench.conformance.gate.environment import REPO_ROOT
from pagedbench.refengine import LoadedModel, ModelConfig, load_model

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "calibrate.yaml"
MODELS = Path(__file__).resolve().parents[2] / "configs" / "models.yaml"


def model_folder(model: str) -> Path | None:
    """``model`` as a Hugging Face folder (relative paths from the repository root, where ``make model`` puts
    SmolLM2), or None for a name of bench/configs/models.yaml."""
    if model in (yaml.safe_load(MODELS.read_text()) or {}):
        return None
    path = Path(model)
    return path if path.is_absolute() else REPO_ROOT / path


def model_config(model: str) -> ModelConfig:
    """The config of ``model`` (see :func:`model_folder`)."""
    folder = model_folder(model)
    if folder is None:
        return ModelConfig.from_yaml(MODELS, name=model)
    return ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))


def load_engine_model(spec: EngineSpec) -> tuple[LoadedModel, ModelConfig]:
    """``spec``'s model, loaded with its dtype and attention backend: seeded random weights for a named config,
    the checkpoint's for a folder."""
    folder = model_folder(spec.model)
    source = model_config(spec.model) if folder is None else folder
    loaded = load_model(source, dtype=spec.dtype, attention_backend=spec.attention_backend, seed=spec.seed)
    return loaded, loaded.config


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The engine of every run (calibration, both real validation runs) and of the simulator."""

    model: str  # a name in bench/configs/models.yaml (seeded random weights), or a model folder (model_config)
    dtype: str  # "float32", "bfloat16", ...
    attention_backend: str  # "torch-batched" (the CPU default), "torch" or "triton"
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    torch_threads: int
    seed: int


@dataclass(frozen=True, slots=True)
class GridSpec:
    """The calibration set: which step shapes are timed (see calibrate.yaml)."""

    warmup_requests: int
    decode_contexts: tuple[int, ...]  # prompt length of each decode run
    spread_contexts: tuple[int, ...]  # one more decode run, its prompts cycling through these lengths
    decode_batches: tuple[int, ...]  # decode batch sizes a run steps down through (decreasing)
    steps_per_batch: int
    mixed_prefill_lens: tuple[int, ...]  # prompts joining a decode batch
    join_batches: tuple[int, ...]  # decode batch size of each join run
    join_prefill_lens: tuple[int, ...]  # short prompts joining a join run's batch, one then two at a time
    prefill_lens: tuple[int, ...]  # lone prompts
    burst_lens: tuple[int, ...]  # a burst of decode_batches[0] prompts cycling through these lengths
    prefill_repeats: int
    wake_gaps_ms: tuple[int, ...]  # idle waits after which a lone prompt's first step is timed
    wake_pairs: int  # (no wait, wait) pairs per gap
    wake_steps: int  # steps timed after each wait (a prefill, then decodes)
    wake_prompt_len: int  # the lone prompt's length
    after_prefill_batches: tuple[int, ...]  # decode batch sizes the steps after a prefill are timed at
    after_prefill_lens: tuple[int, ...]  # the prompts that join them (increasing)
    after_prefill_context: int  # the decoding sequences' prompt length
    after_prefill_steps: int  # decode steps after a prefill priced apart (the rest are its steady state)
    after_prefill_stretch: int  # decode steps between two joins (> after_prefill_steps)
    after_prefill_repeats: int  # joins per batch size and prompt length


@dataclass(frozen=True, slots=True)
class ValidationSpec:
    dataset: str  # a bench.workloads.DATASETS name
    num_requests: int
    length_scale: float
    seed: int
    goal_floor: float  # the goal is max(goal_floor, goal_spread_factor x real-run spread)
    goal_spread_factor: float


@dataclass(frozen=True, slots=True)
class CalibrateConfig:
    path: str
    quick: bool
    engine: EngineSpec
    grid: GridSpec
    validation: ValidationSpec


SECTIONS = {"engine": EngineSpec, "grid": GridSpec, "validation": ValidationSpec}
_MAY_BE_ZERO = {"seed", "warmup_requests"}
_CHOICES = {"attention_backend": ("torch-batched", "torch", "triton"), "dtype": ("float32", "float16", "bfloat16"),
            "dataset": tuple(DATASETS)}


def _lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    """Dotted key -> 1-based line of every mapping key in the YAML node tree."""
    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = f"{prefix}{key.value}"
            out[name] = key.start_mark.line + 1
            out.update(_lines(value, name + "."))
    return out


class _Reader:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            text = path.read_text()
            self.data = yaml.safe_load(text)
            self.lines = _lines(yaml.compose(text, Loader=yaml.SafeLoader))
        except yaml.YAMLError as e:
            raise ProfileError(path, None, None, f"not valid YAML ({e})") from e
        if not isinstance(self.data, dict):
            raise ProfileError(path, None, None, f"expected a mapping, got {type(self.data).__name__}")

        self.origin: dict[str, str] = {}  # "grid.x" -> "quick.grid.x" for a field the quick section set

    def error(self, field: str, problem: str) -> ProfileError:
        field = self.origin.get(field, field)
        return ProfileError(self.path, field, self.lines.get(field), problem)

    def mapping(self, value: Any, field: str, known: typing.Iterable[str]) -> dict:
        if value is None:
            raise self.error(field, "missing")
        if not isinstance(value, dict):
            raise self.error(field, f"expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in known:
                raise self.error(f"{field}.{key}" if field else str(key),
                                 f"unknown field (expected one of {sorted(known)})")
        return value

    def section(self, name: str, quick: bool):
        cls = SECTIONS[name]
        names = [f.name for f in dataclasses.fields(cls)]
        base = self.mapping(self.data.get(name), name, names)
        where = dict.fromkeys(base, name)
        if quick:
            over = self.mapping(self.data.get("quick") or {}, "quick", SECTIONS)
            over = self.mapping(over.get(name) or {}, f"quick.{name}", names)
            base = {**base, **over}
            where.update(dict.fromkeys(over, f"quick.{name}"))
        hints = typing.get_type_hints(cls)
        values = {}
        for key in names:
            if key not in base:
                raise self.error(f"{name}.{key}", "missing")
            self.origin[f"{name}.{key}"] = f"{where[key]}.{key}"
            values[key] = self._value(f"{name}.{key}", key, base[key], hints[key])
        return cls(**values)

    def _value(self, field: str, key: str, value: Any, kind: Any) -> Any:
        if kind is bool:
            if not isinstance(value, bool):
                raise self.error(field, f"expected true or false, got {value!r}")
            return value
        if kind is str:
            choices = _CHOICES.get(key)
            if not isinstance(value, str) or (choices and value not in choices):
                raise self.error(field, f"expected {'one of ' + str(list(choices)) if choices else 'a string'}"
                                        f", got {value!r}")
            return value
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise self.error(field, f"expected a number > 0, got {value!r}")
            return float(value)
        low = 0 if key in _MAY_BE_ZERO else 1
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise self.error(field, f"expected an int >= {low}, got {value!r}")
            return value
        # tuple[int, ...]: a non-empty list of sizes
        if not isinstance(value, list) or not value or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
            raise self.error(field, f"expected a non-empty list of ints >= 1, got {value!r}")
        return tuple(value)


def _check_fits(r: _Reader, cfg: CalibrateConfig) -> None:
    """The grid and the engine agree: every run fits the model length and the KV pool unpreempted."""
    e, g = cfg.engine, cfg.grid
    folder = model_folder(e.model)
    if folder is not None and not (folder / "config.json").is_file():
        known = sorted(yaml.safe_load(MODELS.read_text()))
        raise r.error("engine.model", f"unknown model {e.model!r}: neither a name of {MODELS.name} ({known}) nor a "
                                      f"model folder with a config.json (`make model` prepares SmolLM2's)")
    positions = model_config(e.model).max_position_embeddings
    if e.max_model_len > positions:
        raise r.error("engine.max_model_len", f"{e.max_model_len} exceeds model {e.model!r}'s {positions}")
    if list(g.decode_batches) != sorted(set(g.decode_batches), reverse=True):
        raise r.error("grid.decode_batches", f"expected strictly decreasing sizes, got {list(g.decode_batches)}")
    if g.decode_batches[0] > e.max_num_seqs:
        raise r.error("grid.decode_batches", f"{g.decode_batches[0]} sequences exceed engine.max_num_seqs "
                                             f"{e.max_num_seqs}")
    widest = max(max(g.decode_contexts), max(g.spread_contexts))
    longest = widest + decode_run_tokens(cfg, widest)
    if longest > e.max_model_len:
        field = "grid.decode_contexts" if widest in g.decode_contexts else "grid.spread_contexts"
        raise r.error(field, f"a decode run reaches {longest} tokens, more than "
                             f"engine.max_model_len {e.max_model_len}")
    if g.decode_batches[0] * longest + max(g.mixed_prefill_lens) > e.num_blocks * e.block_size:
        raise r.error("engine.num_blocks", f"{e.num_blocks} blocks of {e.block_size} cannot hold a decode "
                                           f"run ({g.decode_batches[0]} x {longest} tokens) unpreempted")
    if max(g.join_batches) + 2 > e.max_num_seqs:
        raise r.error("grid.join_batches", f"a join run of {max(g.join_batches)} decodes and two joining prompts "
                                           f"exceeds engine.max_num_seqs {e.max_num_seqs}")
    join_longest = max(g.spread_contexts) + join_run_tokens(cfg, max(g.join_batches))
    if join_longest > e.max_model_len:
        raise r.error("grid.join_prefill_lens", f"a join run reaches {join_longest} tokens, more than "
                                                f"engine.max_model_len {e.max_model_len}")
    if max(g.join_batches) * join_longest + 2 * max(g.join_prefill_lens) > e.num_blocks * e.block_size:
        raise r.error("engine.num_blocks", f"{e.num_blocks} blocks of {e.block_size} cannot hold a join run "
                                           f"({max(g.join_batches)} x {join_longest} tokens) unpreempted")
    for name in ("after_prefill_batches", "after_prefill_lens"):
        sizes = getattr(g, name)
        if list(sizes) != sorted(set(sizes)):
            raise r.error(f"grid.{name}", f"expected strictly increasing sizes, got {list(sizes)}")
    if g.after_prefill_stretch <= g.after_prefill_steps:
        raise r.error("grid.after_prefill_stretch", f"a stretch of {g.after_prefill_stretch} decode steps leaves "
                                                    f"no steady state after the {g.after_prefill_steps} priced ones")
    if max(g.after_prefill_batches) + 1 > e.max_num_seqs:
        raise r.error("grid.after_prefill_batches", f"{max(g.after_prefill_batches)} decodes and a joining prompt "
                                                    f"exceed engine.max_num_seqs {e.max_num_seqs}")
    if g.after_prefill_context >= e.max_model_len:
        raise r.error("grid.after_prefill_context", f"prompts must be shorter than engine.max_model_len "
                                                    f"{e.max_model_len}, got {g.after_prefill_context}")
    after_longest = g.after_prefill_context + after_prefill_tokens(cfg)
    if after_longest > e.max_model_len:
        raise r.error("grid.after_prefill_stretch", f"a sequence timed after prefills reaches {after_longest} "
                                                    f"tokens, more than engine.max_model_len {e.max_model_len}")
    if max(g.after_prefill_batches) * after_longest + max(g.after_prefill_lens) > e.num_blocks * e.block_size:
        raise r.error("engine.num_blocks", f"{e.num_blocks} blocks of {e.block_size} cannot hold "
                                           f"{max(g.after_prefill_batches)} x {after_longest} tokens unpreempted")
    for name in ("prefill_lens", "mixed_prefill_lens", "burst_lens", "join_prefill_lens", "after_prefill_lens"):
        if max(getattr(g, name)) >= e.max_model_len:
            raise r.error(f"grid.{name}", f"prompts must be shorter than engine.max_model_len "
                                          f"{e.max_model_len}, got {max(getattr(g, name))}")


def decode_run_tokens(cfg: CalibrateConfig, context: int) -> int:
    """The most tokens a request of a decode run at ``context`` generates: one per prefill step of the
    run (it may be admitted first) plus ``steps_per_batch`` per batch size."""
    e, g = cfg.engine, cfg.grid
    prefill_steps = -(-g.decode_batches[0] * context // e.max_num_batched_tokens)
    return prefill_steps + g.steps_per_batch * len(g.decode_batches) + 1


def after_prefill_tokens(cfg: CalibrateConfig) -> int:
    """The tokens a decoding sequence of the after-prefill runs generates: one per prefill step of its batch,
    a first stretch, then per join its step and a stretch, and one to spare."""
    e, g = cfg.engine, cfg.grid
    prefill_steps = -(-max(g.after_prefill_batches) * g.after_prefill_context // e.max_num_batched_tokens)
    return prefill_steps + g.after_prefill_stretch + g.after_prefill_repeats * (g.after_prefill_stretch + 1) + 1


def join_pairs(lens: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """What joins a join run's batch, one group per join: each of ``lens`` alone, then each beside the
    one two places on (cyclically: pairs of unlike lengths, two chunks in one padded prefill group)."""
    pairs = tuple((a, lens[(i + 2) % len(lens)]) for i, a in enumerate(lens)) if len(lens) > 1 else ()
    return tuple((n,) for n in lens) + pairs


def join_run_tokens(cfg: CalibrateConfig, batch: int) -> int:
    """The most tokens a decode request of a join run of ``batch`` generates: one per prefill step of the
    batch (chunked by the token budget) plus two per join, and one to spare."""
    e, g = cfg.engine, cfg.grid
    prefill_steps = -(-batch * max(g.spread_contexts) // e.max_num_batched_tokens)
    return prefill_steps + 2 * len(join_pairs(g.join_prefill_lens)) + 1


def load_config(path: str | Path = CONFIG, *, quick: bool = False) -> CalibrateConfig:
    """Read and check ``path`` (see the module docstring)."""
    r = _Reader(Path(path))
    r.mapping(r.data, "", [*SECTIONS, "quick"])
    cfg = CalibrateConfig(str(path), quick, *(r.section(name, quick) for name in SECTIONS))
    _check_fits(r, cfg)
    return cfg
