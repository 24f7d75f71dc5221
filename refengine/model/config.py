"""The shape of a Llama-family decoder: :class:`ModelConfig`, read from Hugging Face, YAML or a dict.

Two architectures are supported, both served by :class:`refengine.model.LlamaModel`:

==================  =======================================  =====================
architecture        attention projections                    Hugging Face class
==================  =======================================  =====================
``llama``           q/k/v/o biases all on iff attention_bias  ``LlamaForCausalLM``
``qwen2``           q/k/v biases on, o_proj without           ``Qwen2ForCausalLM``
==================  =======================================  =====================

Rotary embeddings: plain (``rope_theta``), or scaled as :class:`RopeScaling` says (``linear``:
position interpolation; ``llama3``: Llama 3.1's frequency-band rescaling). What the model does not
implement is refused by :meth:`ModelConfig.from_hf_dict` with :class:`UnsupportedModelError` (another
architecture, rope types such as ``yarn`` or ``dynamic``, sliding-window layers, an activation other
than SiLU, MLP biases), never silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from pagedbench.refengine.errors import InvalidArgumentError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
}

#: Hugging Face ``architectures`` entry -> our architecture name
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


class UnsupportedModelError(InvalidArgumentError):
    """A checkpoint asks for something the model does not implement (architecture, rope scaling...)."""


ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rescaled rotary frequencies (Hugging Face's ``rope_parameters`` / ``rope_scaling``).

    ``linear``: every inverse frequency divided by ``factor``. ``llama3``: wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, shorter than
    ``original_max_position_embeddings / high_freq_factor`` kept, the band between interpolated smoothly.
    """

    rope_type: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise UnsupportedModelError(
                f"rotary scaling {self.rope_type!r} is not implemented "
                f"(supported: plain rope, {', '.join(map(repr, ROPE_SCALING_TYPES))})"
            )
        if not self.factor > 0:
            raise InvalidArgumentError(f"rope scaling factor must be > 0; got {self.factor}")
        if self.rope_type == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor and self.original_max_position_embeddings > 0
        ):
            raise InvalidArgumentError(
                "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and "
                f"original_max_position_embeddings > 0; got {self.low_freq_factor}, {self.high_freq_factor}, "
                f"{self.original_max_position_embeddings}"
            )


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or a name (``"float32"``, ``"bfloat16"``, ``"bf16"``...) -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype}")
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        if name in DTYPES:
            return DTYPES[name]
    raise InvalidArgumentError(f"dtype must be a torch dtype or one of {', '.join(DTYPES)}; got {dtype!r}")


def dtype_name(dtype: torch.dtype | str) -> str:
    """The canonical name (``"bfloat16"``) of a dtype or dtype name."""
    resolved = resolve_dtype(dtype)
    return next(name for name, d in DTYPES.items() if d == resolved)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (names as in Hugging Face's ``config.json``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # width of the SwiGLU MLP
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int | None = None  # None -> num_attention_heads (no GQA)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain rotary embeddings (a dict is converted)
    max_position_embeddings: int = 2048  # longest sequence (prompt + output) the model accepts
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # the output projection has a bias (Llama's attention_bias only)
    eos_token_id: int | tuple[int, ...] | None = None
    torch_dtype: str = "float32"  # the checkpoint's dtype name: float32, float16 or bfloat16
    architecture: str = "llama"  # "llama" or "qwen2" (informational; both run the same module)

    def __post_init__(self) -> None:
        # Fill the two derived defaults at construction (the object is never changed afterwards).
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None and _positive_int(self.num_attention_heads):
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.torch_dtype, torch.dtype | str):
            object.__setattr__(self, "torch_dtype", dtype_name(self.torch_dtype))
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise InvalidArgumentError(f"ModelConfig.{name} must be a positive int; got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgumentError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgumentError(f"head_dim must be even for rotary embeddings; got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise InvalidArgumentError(
                f"rms_norm_eps and rope_theta must be > 0; got {self.rms_norm_eps}, {self.rope_theta}"
            )
        if self.architecture not in HF_ARCHITECTURES.values():
            raise UnsupportedModelError(
                f"architecture must be one of {sorted(HF_ARCHITECTURES.values())}; got {self.architecture!r}"
            )
        for eos in self.eos_token_ids:
            if not (isinstance(eos, int) and 0 <= eos < self.vocab_size):
                raise InvalidArgumentError(
                    f"eos_token_id {eos!r} is outside the vocabulary [0, {self.vocab_size})"
                )

    # --- derived values ----------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's dtype as a torch dtype."""
        return DTYPES[self.torch_dtype]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id (empty when the model has none)."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> ModelConfig:
        """A new config with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for result records and YAML (``from_dict(to_dict())`` round-trips)."""
        d = dataclasses.asdict(self)
        if isinstance(d["eos_token_id"], tuple):
            d["eos_token_id"] = list(d["eos_token_id"])
        return d

    # --- factories ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Our own field names (as :meth:`to_dict` writes them); an unknown key is an error naming it."""
        if not isinstance(d, Mapping):
            raise InvalidArgumentError(f"a model config must be a mapping; got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown ModelConfig keys {unknown}; known: {sorted(known)}")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise InvalidArgumentError(f"model config is missing required keys {missing}")
        return cls(**dict(d))

    @classmethod
    def from_yaml(cls, path: str | Path, name: str | None = None) -> ModelConfig:
        """A config from a YAML file: the whole file, or its entry ``name`` when it holds named configs."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config YAML {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, Mapping):
            raise InvalidArgumentError(
                f"{path}: expected a mapping at the top level; got {type(data).__name__}"
            )
        if name is None and "vocab_size" not in data:
            raise InvalidArgumentError(f"{path} holds named configs {sorted(data)}; pass name=")
        if name is not None:
            if name not in data:
                raise InvalidArgumentError(f"{path} has no model config {name!r}; it has {sorted(data)}")
            data = data[name]
        return cls.from_dict(data)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """A config from a Hugging Face ``config.json`` (transformers 4.x or 5.x keys) of Llama or Qwen2."""
        return cls(**_translate_hf_config(d))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# --- Hugging Face config.json -> our fields ---------------------------------------------------------
_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_HF_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768}


def _hf_architecture(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        unknown = [a for a in archs if a not in HF_ARCHITECTURES]
        if unknown or len(set(archs)) != 1:
            raise UnsupportedModelError(
                f"unsupported architectures {list(archs)}; supported: {sorted(HF_ARCHITECTURES)}"
            )
        return HF_ARCHITECTURES[archs[0]]
    model_type = d.get("model_type")
    if model_type in HF_ARCHITECTURES.values():
        return model_type
    raise UnsupportedModelError(
        f"config has no supported 'architectures' ({sorted(HF_ARCHITECTURES)}) and model_type {model_type!r}"
    )


def _hf_rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from ``rope_parameters`` (transformers 5) and/or ``rope_scaling`` (4)."""
    parsed = [_parse_rope(d[key], d) for key in ("rope_parameters", "rope_scaling") if d.get(key)]
    if not parsed:
        return float(d.get("rope_theta", 10000.0)), None
    scaled = {p[1] for p in parsed if p[1] is not None}
    if len(scaled) > 1:
        raise UnsupportedModelError(f"rope_parameters and rope_scaling disagree: {sorted(map(str, scaled))}")
    return parsed[0][0], scaled.pop() if scaled else None


def _parse_rope(source: Mapping[str, Any], d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    params = dict(source)
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not implemented")
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_SCALING_TYPES:
        raise UnsupportedModelError(
            f"rotary scaling {rope_type!r} is not implemented "
            f"(supported: plain rope, {', '.join(map(repr, ROPE_SCALING_TYPES))})"
        )
    keys = {"factor"} if rope_type == "linear" else {
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    unknown = sorted(set(params) - keys)
    if unknown:
        raise UnsupportedModelError(f"{rope_type} rope scaling keys {unknown} are not implemented")
    return theta, RopeScaling(rope_type=rope_type, **params)


def _hf_check_features(d: Mapping[str, Any]) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not implemented (supported: 'silu')")
    if d.get("mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=true is not implemented")
    if d.get("use_sliding_window", False):
        raise UnsupportedModelError("sliding-window attention (use_sliding_window=true) is not implemented")
    layer_types = d.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise UnsupportedModelError(f"layer types {other} are not implemented (supported: 'full_attention')")


def _translate_hf_config(d: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        raise InvalidArgumentError(f"a Hugging Face config must be a mapping; got {type(d).__name__}")
    arch = _hf_architecture(d)
    _hf_check_features(d)
    missing = [k for k in _HF_REQUIRED if d.get(k) is None]
    if missing:
        raise InvalidArgumentError(f"config.json is missing required keys {missing}")
    llama_bias = bool(d.get("attention_bias", False))
    rope_theta, rope_scaling = _hf_rope(d)
    dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    return {
        **{k: d[k] for k in _HF_REQUIRED},
        "num_key_value_heads": d.get("num_key_value_heads"),
        "head_dim": d.get("head_dim"),
        "rms_norm_eps": float(d.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": d.get("max_position_embeddings", _HF_DEFAULT_MAX_POSITIONS[arch]),
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
        "attention_bias": True if arch == "qwen2" else llama_bias,
        "o_proj_bias": False if arch == "qwen2" else llama_bias,
        "eos_token_id": d.get("eos_token_id"),
        "torch_dtype": dtype,
        "architecture": arch,
    }
