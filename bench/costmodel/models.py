"""Model profiles (``bench/configs/models/<name>.yaml``): a decoder's shape in Hugging Face config.json terms.

The shape is all the step-cost roofline needs: bytes of weights streamed per step, FLOPs per token,
KV bytes per token. Four architectures differ in what the shape alone does not say:

=============  ===========================  ===================  ==================  ==============
architecture   MLP                          linear biases        norms per layer     positions
=============  ===========================  ===================  ==================  ==============
``opt``        fc1 -> ReLU -> fc2           all                  2 LayerNorm (w, b)  learned table
``llama``      gate, up -> SwiGLU -> down   none                 2 RMSNorm (w)       rotary
``qwen``       gate, up -> SwiGLU -> down   q, k, v only         2 RMSNorm (w)       rotary
``phi``        fc1 -> GELU -> fc2           all (and lm_head)    1 LayerNorm (w, b)  rotary
=============  ===========================  ===================  ==================  ==============
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedbench.bench.costmodel.profile_fields import (
    FieldSpec,
    one_of,
    positive,
    profile_path,
    read_profile,
)

MODELS_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"


@dataclass(frozen=True, slots=True)
class _Traits:
    gated_mlp: bool  # three MLP matrices (gate, up, down) instead of two
    qkv_bias: bool
    other_linear_bias: bool  # o_proj / fc1 / fc2 biases
    norm_params_per_hidden: int  # per layer: 2 LayerNorms with bias = 4, 2 RMSNorms = 2, 1 LayerNorm = 2
    final_norm_params_per_hidden: int
    lm_head_bias: bool
    learned_positions: bool  # OPT: a (max_positions + 2) x hidden table (2 = its padding offset)


_TRAITS = {
    "opt": _Traits(False, True, True, 4, 2, False, True),
    "llama": _Traits(True, False, False, 2, 1, False, False),
    "qwen": _Traits(True, True, False, 2, 1, False, False),
    "phi": _Traits(False, True, True, 2, 2, True, False),
}


#: bytes of one stored KV element by the engine's kv_cache_dtype names (None: the model's dtype_bytes)
KV_CACHE_DTYPE_BYTES: dict[str, int | None] = {"auto": None, "fp8_e4m3": 1}


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A decoder's shape (field names as in Hugging Face config.json) and what follows from it."""

    name: str
    architecture: str  # a key of _TRAITS
    hidden_size: int
    intermediate_size: int  # per MLP branch (Qwen's config.json lists twice this)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype_bytes: int  # 2 for float16 / bfloat16

    @property
    def gated_mlp(self) -> bool:
        return _TRAITS[self.architecture].gated_mlp

    @property
    def linear_params_per_layer(self) -> int:
        """Weights and biases of one layer's matrices (q, k, v, o and the MLP): what a GEMM streams."""
        t = _TRAITS[self.architecture]
        h, i = self.hidden_size, self.intermediate_size
        q_out, kv_out = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = h * (q_out + 2 * kv_out) + q_out * h
        mlp = (3 if t.gated_mlp else 2) * h * i
        bias = (q_out + 2 * kv_out) * t.qkv_bias + (h + i + h) * t.other_linear_bias
        return attn + mlp + bias

    @property
    def params_per_layer(self) -> int:
        norms = _TRAITS[self.architecture].norm_params_per_hidden * self.hidden_size
        return self.linear_params_per_layer + norms

    @property
    def lm_head_params(self) -> int:
        """The output projection's matrix (shared with the embedding when tied: still read every step)."""
        return self.vocab_size * self.hidden_size + self.vocab_size * _TRAITS[self.architecture].lm_head_bias

    @property
    def num_params(self) -> int:
        """Every parameter, counted once (a tied lm_head is the embedding)."""
        t = _TRAITS[self.architecture]
        h = self.hidden_size
        embed = self.vocab_size * h
        positions = (self.max_position_embeddings + 2) * h if t.learned_positions else 0
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        head += self.vocab_size if (self.tie_word_embeddings and t.lm_head_bias) else 0
        return (self.num_hidden_layers * self.params_per_layer + embed + positions + head
                + t.final_norm_params_per_hidden * h)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype_bytes

    def kv_bytes_per_token_as(self, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token in every layer, stored as ``kv_cache_dtype`` ("auto": the model's dtype;
        "fp8_e4m3": one byte an element, as ``LLM(kv_cache_dtype=...)`` stores them)."""
        if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_BYTES)}; got {kv_cache_dtype!r}")
        element = KV_CACHE_DTYPE_BYTES[kv_cache_dtype] or self.dtype_bytes
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element

    @property
    def gemm_io_elements_per_token_per_layer(self) -> int:
        """Activation elements the layer's GEMMs read and write per token (inputs plus outputs)."""
        h, i = self.hidden_size, self.intermediate_size
        q_out, kv_out = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        up_out = (2 if self.gated_mlp else 1) * i
        return (h + q_out + 2 * kv_out) + (q_out + h) + (h + up_out) + (i + h)


_SPECS = {
    "name": FieldSpec(str),
    "architecture": one_of(*_TRAITS),
    "hidden_size": positive(int),
    "intermediate_size": positive(int),
    "num_hidden_layers": positive(int),
    "num_attention_heads": positive(int),
    "num_key_value_heads": positive(int),
    "head_dim": positive(int),
    "vocab_size": positive(int),
    "max_position_embeddings": positive(int),
    "tie_word_embeddings": FieldSpec(bool),
    "dtype_bytes": FieldSpec(int, lambda v: v in (1, 2, 4), "one of [1, 2, 4]"),
}


def load_model(name: str, directory: Path = MODELS_DIR) -> ModelProfile:
    """The profile ``directory/<name>.yaml``; :class:`ProfileError` if unknown or invalid."""
    path = profile_path(directory, name)
    read = read_profile(path, _SPECS)
    fields = read.values
    if fields["name"] != name:
        raise read.error(path, "name", f"expected {name!r} (the file name), got {fields['name']!r}")
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise read.error(path, "num_key_value_heads",
                         f"must divide num_attention_heads={fields['num_attention_heads']}, "
                         f"got {fields['num_key_value_heads']}")
    return ModelProfile(**fields)


def model_names(directory: Path = MODELS_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))
