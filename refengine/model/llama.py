"""A Llama-family decoder in plain torch, attending through a paged KV cache.

Per layer, for the step's ``T`` flattened tokens (see :mod:`refengine.attention_backend`)::

    x --RMSNorm--> qkv proj (+bias) --rotary(positions)--> backend: write_kv, paged attention --o_proj--+
    |                                                                                                    |
    +<---------------------------------------------------------------------------------------------------+
    x --RMSNorm--> down( silu(gate(x)) * up(x) ) --> + x

q/k/v and gate/up each run as one matmul over weights concatenated once (:mod:`fused_linear`); the
parameters keep Hugging Face's names, as views of the fused tensors.

The numerics follow Hugging Face's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` step for step (RMSNorm in
float32 then cast back before the weight, rotary cos/sin computed in float32 and cast to the activations'
dtype, the ``rotate_half`` convention), so float32 logits agree to rounding.

With ``meta.batch_invariant`` the same layers run on a row count padded to whole tiles, every linear
layer one tile at a time, and attention in a fixed order (:mod:`batch_invariance`): a request's logits
are then bit-identical whatever else the step holds. The padding rows never reach attention or the
cache.
"""

from __future__ import annotations

import math

import torch
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.model.attention_backend import AttentionBackend, AttentionMetadata
from pagedbench.refengine.model.batch_invariance import linear, linear_weights, pad_rows, padded_rows
from pagedbench.refengine.model.config import ModelConfig, RopeScaling
from pagedbench.refengine.model.fused_linear import FusedLinear, fuse, fused
from pagedbench.refengine.model.prepacked_linear import LinearPath, choose_paths
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the statistic in float32. x [..., hidden] any float dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, rope_theta: float, scaling: RopeScaling | None,
                  device: torch.device | None = None) -> torch.Tensor:
    """float32 [head_dim / 2]: theta^(-2i/D), rescaled as ``scaling`` says (see :class:`RopeScaling`)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, the band between interpolated
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with ``rope_theta`` (and optional scaling), HF's ``rotate_half`` layout.

    The frequency ``i`` rotates the pair (x[i], x[i + D/2]) by ``position * inv_freq[i]``.
    """

    def __init__(self, head_dim: int, rope_theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        # Not a buffer: model.to(bfloat16) must not round the frequencies (they are recomputed per step).
        self.head_dim, self.rope_theta, self.scaling = head_dim, rope_theta, scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> cos, sin [T, 1, D] in ``dtype`` (computed in float32)."""
        inv_freq = rope_inv_freq(self.head_dim, self.rope_theta, self.scaling, positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> x rotated (same shape and dtype)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention over the paged cache; q/k/v (and o) biases where the config says."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        d, hq, hkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.scale = 1.0 / math.sqrt(d)
        self.backend = backend
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=config.o_proj_bias)
        self.qkv_fusion: FusedLinear | None = None  # q/k/v as one matmul (``fused_linear``)
        self.qkv_path, self.o_path = LinearPath(), LinearPath()  # F.linear or oneDNN (``prepacked_linear``)

    def fuse_projections(self) -> None:
        """q/k/v_proj's weights into one tensor (theirs become views of it): one matmul per forward."""
        self.qkv_fusion = fuse((self.q_proj, self.k_proj, self.v_proj))

    def linear_sites(self) -> dict:
        """``{"qkv": (path, weight, bias), "o": ...}`` (``qkv`` None when q/k/v cannot be fused)."""
        self.qkv_fusion = f = fused(self.qkv_fusion, (self.q_proj, self.k_proj, self.v_proj))
        return {"qkv": None if f is None else (self.qkv_path, f.weight, f.bias),
                "o": (self.o_path, self.o_proj.weight, self.o_proj.bias)}

    def _qkv(self, x: torch.Tensor, inv: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq * D], k and v [T, Hkv * D] (views of one product when fused)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_fusion = fused(self.qkv_fusion, parts)  # again if a part was replaced (sharding, .to())
        f = self.qkv_fusion
        if f is None:
            return tuple(linear(p, x, inv) for p in parts)
        qkv = linear_weights(x, f.weight, f.bias, True) if inv else self.qkv_path(x, f.weight, f.bias)
        return qkv.split(f.split_sizes, dim=-1)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into ``kv_cache`` (k, v caches).

        Batch-invariant: x has padding rows past the step's ``meta.num_tokens``; they skip attention."""
        t, inv = x.shape[0], meta.batch_invariant
        q, k, v = self._qkv(x, inv)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q = RotaryEmbedding.apply(q, cos, sin)
        k = RotaryEmbedding.apply(k, cos, sin)
        n = meta.num_tokens
        if inv and n < t:
            q, k, v = q[:n], k[:n], v[:n]
        out = self.backend.forward(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale)
        out = out.reshape(n, self.num_heads * self.head_dim)
        if inv:
            return linear(self.o_proj, pad_rows(out, t), True)
        return self.o_path.of(self.o_proj, out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). x [T, hidden] -> [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_fusion: FusedLinear | None = None  # gate/up as one matmul (``fused_linear``)
        self.gate_up_path, self.down_path = LinearPath(), LinearPath()  # (``prepacked_linear``)

    def fuse_projections(self) -> None:
        """gate/up_proj's weights into one tensor (theirs become views of it): one matmul per forward."""
        self.gate_up_fusion = fuse((self.gate_proj, self.up_proj))

    def linear_sites(self) -> dict:
        """``{"gate_up": (path, weight, bias), "down": ...}`` (``gate_up`` None when they cannot be fused)."""
        self.gate_up_fusion = f = fused(self.gate_up_fusion, (self.gate_proj, self.up_proj))
        return {"gate_up": None if f is None else (self.gate_up_path, f.weight, f.bias),
                "down": (self.down_path, self.down_proj.weight, self.down_proj.bias)}

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        parts = (self.gate_proj, self.up_proj)
        self.gate_up_fusion = f = fused(self.gate_up_fusion, parts)
        if f is None:
            gate, up = linear(self.gate_proj, x, invariant), linear(self.up_proj, x, invariant)
        elif invariant:
            gate, up = linear_weights(x, f.weight, f.bias, True).split(f.split_sizes, dim=-1)
        else:
            gate, up = self.gate_up_path(x, f.weight, f.bias).split(f.split_sizes, dim=-1)
        if invariant:
            return linear(self.down_proj, F.silu(gate) * up, True)
        return self.down_path.of(self.down_proj, F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x), meta.batch_invariant)


class LlamaModel(nn.Module):
    """Embeddings, ``num_hidden_layers`` decoder layers, the final norm and the LM head.

    Parameter names match Hugging Face's checkpoints (``model.layers.0.self_attn.q_proj.weight``...,
    ``lm_head.weight``), so a safetensors state dict loads with ``load_state_dict`` directly. With tied
    embeddings ``lm_head.weight`` *is* ``model.embed_tokens.weight``.
    """

    def __init__(self, config: ModelConfig, *, attention_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        self.model = nn.Module()  # HF's prefix: model.embed_tokens, model.layers, model.norm
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(
            DecoderLayer(config, attention_backend) for _ in range(config.num_hidden_layers)
        )
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.lm_head_path = LinearPath()

    def fuse_projections(self) -> None:
        """Every layer's q/k/v and gate/up weights concatenated (one matmul each; ``fused_linear``). The
        loader calls it once the model is built; a forward re-fuses a layer whose parts were replaced."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def set_linear_paths(self, mode: str) -> dict[str, dict]:
        """Choose F.linear or prepacked oneDNN per call site (``prepacked_linear``; ``mode`` "auto",
        "torch" or "onednn") on layer 0's weights, apply the choice to every layer and pack the weights
        now. Returns the choice per site, with the timings where measured."""
        # a part that cannot be fused (None) runs F.linear on its own layers, outside any path
        sites = [{name: site for name, site in {**layer.self_attn.linear_sites(), **layer.mlp.linear_sites()}.items()
                  if site is not None} for layer in self.model.layers]
        sites[0]["lm_head"] = (self.lm_head_path, self.lm_head.weight, self.lm_head.bias)
        chosen = choose_paths({name: site[1:] for name, site in sites[0].items()}, mode)
        for layer_sites in sites:
            for name, (path, weight, _) in layer_sites.items():
                path.use(chosen.get(name, {}).get("path") == "onednn", weight)
        return chosen

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """One step over ``T`` flattened tokens.

        input_ids int64 [T]; positions int64 [T] (each token's position in its sequence);
        kv_caches: per layer (k_cache, v_cache) [num_blocks, block_size, Hkv, D] in the model's dtype.
        Returns the final-norm hidden states [T, hidden_size] in the model's dtype.
        """
        self._check_step(input_ids, positions, meta, kv_caches)
        plan = getattr(self.attention_backend, "plan", None)  # a hand-made backend may have none
        if plan is not None:
            meta = plan(meta, kv_caches[0][0].shape[1])  # once per step, shared by every layer
        t = meta.num_tokens
        if meta.batch_invariant:  # whole row tiles; the padding rows are token 0 at position 0
            input_ids, positions = pad_rows(input_ids, padded_rows(t)), pad_rows(positions, padded_rows(t))
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, meta, kv_cache)
        return self.model.norm(x)[:t]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, *, batch_invariant: bool = False) -> torch.Tensor:
        """hidden [N, hidden_size] (model dtype) -> float32 logits [N, vocab_size].

        The LM head runs in the model's dtype (as Hugging Face does); the result is cast to float32.
        ``batch_invariant``: on whole row tiles, so a row's logits do not depend on N.
        """
        if not batch_invariant:
            return self.lm_head_path.of(self.lm_head, hidden).to(torch.float32)
        n = hidden.shape[0]
        return linear(self.lm_head, pad_rows(hidden, padded_rows(n)), True)[:n].to(torch.float32)

    def _check_step(self, input_ids, positions, meta, kv_caches) -> None:
        t = meta.num_tokens
        if input_ids.shape != (t,) or positions.shape != (t,):
            raise InvalidArgumentError(
                f"input_ids and positions must be [T={t}] (sum of meta.query_lens); "
                f"got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(kv_caches) != self.config.num_hidden_layers:
            raise InvalidArgumentError(
                f"kv_caches must hold one (k, v) pair per layer ({self.config.num_hidden_layers}); "
                f"got {len(kv_caches)}"
            )
        if kv_caches[0][0].dtype not in (self.dtype, torch.float8_e4m3fn):  # fp8: the backend (de)quantizes
            raise InvalidArgumentError(
                f"KV cache dtype {kv_caches[0][0].dtype} differs from the model's {self.dtype}"
            )


def init_random_weights(model: LlamaModel, seed: int) -> None:
    """Seeded random weights, drawn in float32 on the CPU then copied in (a seed gives the same model on
    any device and dtype): embeddings N(0, 1) (N(0, 0.1^2) when tied to the LM head, or the input token's
    own embedding would dominate its logits), linear weights N(0, 1/fan_in), biases N(0, 0.1^2), norms
    1 + N(0, 0.1^2). The spread keeps logits well separated, so greedy decoding is not decided by rounding.
    """
    gen = torch.Generator().manual_seed(seed)
    embed_std = 0.1 if model.config.tie_word_embeddings else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied weights are listed once
            shape = tuple(param.shape)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif name.endswith("bias"):
                value = 0.1 * torch.randn(shape, generator=gen)
            elif "embed_tokens" in name:
                value = embed_std * torch.randn(shape, generator=gen)
            else:
                value = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            param.copy_(value)
