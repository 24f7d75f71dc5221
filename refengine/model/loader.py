"""Build a :class:`~refengine.model.LlamaModel`: from a local Hugging Face folder, or seeded random weights.

A Hugging Face folder holds ``config.json`` and its weights in ``*.safetensors`` (one file, or shards
listed by ``model.safetensors.index.json``); ``tokenizer.json``, when present, is loaded with the
``tokenizers`` package, and ``generation_config.json``'s ``eos_token_id`` (when set) overrides the
config's. Nothing is ever fetched from a hub: a path that does not exist is an error.

Tensor names map one to one onto the module (``model.embed_tokens.weight``,
``model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}``, ``model.layers.N.mlp.{gate,up,down}_proj.weight``,
``model.layers.N.{input,post_attention}_layernorm.weight``, ``model.norm.weight``, ``lm_head.weight``).
The check is strict: a missing tensor, an unexpected one or a wrong shape is a :class:`CheckpointError`
naming it; ``lm_head.weight`` may be absent only when the config ties it to the embeddings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.model.attention_backend import AttentionBackend, get_attention_backend
from pagedbench.refengine.model.config import ModelConfig, dtype_name, resolve_dtype
from pagedbench.refengine.model.llama import LlamaModel, init_random_weights

#: tensors some older checkpoints carry that are recomputed, never loaded
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(InvalidArgumentError):
    """A Hugging Face folder whose files do not match what its config describes."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaModel  # on ``device``, in the loaded dtype, inference only
    config: ModelConfig  # the model's config; torch_dtype is the dtype the weights were loaded in
    tokenizer: Any | None  # a ``tokenizers.Tokenizer`` when the folder has tokenizer.json, else None
    source: str  # the folder path, or "random(seed=N)" for a random model


def load_model(
    source: str | Path | ModelConfig | Mapping[str, Any],
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attention_backend: str | AttentionBackend | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Load a model.

    ``source``: a local Hugging Face folder; or a :class:`ModelConfig`, a dict of its fields, or a YAML
    file of one config, for a model with seeded random weights (``seed``; benchmarks and tests).
    ``dtype``: a torch dtype or its name; None = the checkpoint's ``torch_dtype`` (float32 if unset).
    ``device``: None = the backend's device (``kernels.device.backend().torch_device``).
    ``attention_backend``: "triton", "torch", "torch-batched", an instance, or None (triton on a GPU,
    torch-batched on the CPU).
    """
    backend = get_attention_backend(attention_backend)
    device = torch.device(device) if device is not None else _default_device()
    if isinstance(source, ModelConfig | Mapping) or _is_yaml(source):
        config = _random_config(source)
        model = _build(config, dtype, device, backend)
        init_random_weights(model, seed)
        return LoadedModel(model, model.config, None, f"random(seed={seed})")
    folder = Path(source).expanduser()
    if not folder.exists():
        raise FileNotFoundError(
            f"model folder {str(folder)!r} does not exist (only local Hugging Face folders are loaded)"
        )
    if not folder.is_dir():
        raise InvalidArgumentError(f"{str(folder)!r} is neither a model folder nor a .yaml model config")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    config = _with_generation_eos(ModelConfig.from_hf_dict(json.loads(config_path.read_text())), folder)
    state, sources = _read_safetensors(folder)
    model = _build(config, dtype, device, backend)
    _load_state(model, state, sources)
    return LoadedModel(model, model.config, _load_tokenizer(folder), str(folder))


def _default_device() -> torch.device:
    from pagedbench.kernels import device

    return device.backend().torch_device


def _is_yaml(source: object) -> bool:
    return isinstance(source, str | Path) and Path(source).suffix.lower() in (".yaml", ".yml")


def _random_config(source: ModelConfig | Mapping[str, Any] | str | Path) -> ModelConfig:
    if isinstance(source, ModelConfig):
        return source
    if isinstance(source, Mapping):
        return ModelConfig.from_dict(source)
    return ModelConfig.from_yaml(source)


def _build(config: ModelConfig, dtype, device: torch.device, backend: AttentionBackend) -> LlamaModel:
    """An uninitialised model on ``device`` in ``dtype`` (parameters allocated, not filled)."""
    resolved = resolve_dtype(dtype) if dtype is not None else config.dtype
    config = config.replace(torch_dtype=dtype_name(resolved))
    with torch.device("meta"):
        model = LlamaModel(config, attention_backend=backend)
    model = model.to_empty(device=device).to(resolved)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.fuse_projections()  # before the weights are copied in: they land in the fused tensors
    model.requires_grad_(False)
    return model.eval()


def _with_generation_eos(config: ModelConfig, folder: Path) -> ModelConfig:
    """``generation_config.json``'s eos_token_id, when it has one, overrides config.json's (as HF's
    ``generate`` does: chat checkpoints list their end-of-turn ids there)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return config
    eos = json.loads(path.read_text()).get("eos_token_id")
    return config if eos is None else config.replace(eos_token_id=eos)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} lists shards that are not in the folder: {absent}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights (other formats are not read)")
    return files


def _read_safetensors(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Every tensor of every shard, on the CPU in the checkpoint's dtype, and the file each came from;
    a name in two shards, or a file safetensors cannot read, is an error naming the file."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    sources: dict[str, Path] = {}
    for path in _weight_files(folder):
        try:
            tensors = load_file(str(path), device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        for name, tensor in tensors.items():
            if name in state:
                raise CheckpointError(
                    f"tensor {name!r} appears in more than one shard ({sources[name].name} and {path.name})"
                )
            state[name] = tensor
            sources[name] = path
    return state, sources


def _load_state(model: LlamaModel, state: dict[str, torch.Tensor], sources: dict[str, Path] | None = None) -> None:
    """Copy ``state`` into ``model`` (cast to its dtype), after the strict name and shape check."""
    tied = model.config.tie_word_embeddings
    expected = model.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if tied:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the shared matrix twice
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not match the {model.config.architecture} config: "
            f"missing tensors {missing}, unexpected tensors {unexpected}"
        )
    sources = sources or {}

    def where(name: str) -> str:
        return f"{sources[name]}: " if name in sources else ""

    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{where(name)}tensor {name!r} has shape {tuple(tensor.shape)}; the config expects "
                f"{tuple(expected[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in state.items():
            expected[name].copy_(tensor)  # state_dict() entries share storage with the parameters
            # one finiteness check per tensor, after the cast; the file's own values are looked at only
            # to name the fault (a NaN/Inf stored, or a value the model's dtype cannot hold)
            if not _all_finite(expected[name]):
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    raise CheckpointError(f"{where(name)}tensor {name!r} holds {bad} NaN or Inf values")
                raise CheckpointError(f"{where(name)}tensor {name!r} overflows {expected[name].dtype}: "
                                      f"values up to {float(tensor.abs().max()):.3g}")


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``. One pass: a sum is finite only if every term is (NaN and Inf propagate);
    only a sum that overflows, or a real fault, takes the exact elementwise check (a bool per element,
    ~4x slower)."""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _load_tokenizer(folder: Path) -> Any | None:
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        import tokenizers
    except ImportError:
        return None
    return tokenizers.Tokenizer.from_file(str(path))
