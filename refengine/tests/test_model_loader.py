"""Loading models: Hugging Face folders (strict tensor check, clear errors), configs, random models,
attention metadata and backend selection."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from pagedbench.refengine import ModelConfig, load_model  # noqa: E402
from pagedbench.refengine.errors import InvalidArgumentError  # noqa: E402
from pagedbench.refengine.model.attention_backend import (  # noqa: E402
    AttentionMetadata,
    TorchBackend,
    get_attention_backend,
)
from pagedbench.refengine.model.config import UnsupportedModelError  # noqa: E402
from pagedbench.refengine.model.loader import CheckpointError  # noqa: E402

MODELS_YAML = Path(__file__).resolve().parents[2] / "bench" / "configs" / "models.yaml"
TINY_FIELDS = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
)


def save_tiny_llama(folder, **overrides):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=None, bos_token_id=None, **overrides,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture
def llama_folder(tmp_path):
    return save_tiny_llama(tmp_path / "llama")


def rewrite_weights(folder, edit) -> None:
    path = folder / "model.safetensors"
    state = dict(safetensors_torch.load_file(str(path)))
    edit(state)
    safetensors_torch.save_file(state, str(path), metadata={"format": "pt"})


def edit_config(folder, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


# --- Hugging Face folders ------------------------------------------------------------------------------
def test_loads_weights_bit_exactly(llama_folder):
    loaded = load_model(llama_folder, attention_backend="torch")
    state = safetensors_torch.load_file(str(llama_folder / "model.safetensors"))
    ours = loaded.model.state_dict()
    assert set(ours) == set(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor), name
    assert loaded.tokenizer is None and loaded.source == str(llama_folder)
    assert loaded.config.architecture == "llama" and loaded.config.num_key_value_heads == 2


def test_missing_tensor_is_named(llama_folder):
    rewrite_weights(llama_folder, lambda s: s.pop("model.layers.0.mlp.up_proj.weight"))
    missing = re.escape("missing tensors ['model.layers.0.mlp.up_proj.weight']")
    with pytest.raises(CheckpointError, match=missing):
        load_model(llama_folder)


def test_unexpected_tensor_is_named(llama_folder):
    rewrite_weights(llama_folder, lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model\.layers\.0\.extra\.weight'\]"):
        load_model(llama_folder)


def test_wrong_shape_names_expected_and_actual(llama_folder):
    rewrite_weights(llama_folder, lambda s: s.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(31,\).*expects \(32,\)"):
        load_model(llama_folder)


def test_shape_error_names_the_file(llama_folder):
    rewrite_weights(llama_folder, lambda s: s.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(CheckpointError, match=re.escape(str(llama_folder / "model.safetensors"))):
        load_model(llama_folder)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_weights_are_refused_naming_file_and_tensor(llama_folder, bad):
    def poison(state):
        state["model.layers.0.mlp.up_proj.weight"][3, 5] = bad

    rewrite_weights(llama_folder, poison)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj"
                                              r"\.weight' holds 1 NaN or Inf values"):
        load_model(llama_folder)


def test_weights_that_overflow_the_chosen_dtype_are_refused(llama_folder):
    rewrite_weights(llama_folder, lambda s: s["model.norm.weight"].__setitem__(0, 1e6))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' overflows torch\.float16"):
        load_model(llama_folder, dtype="float16")


def test_a_corrupt_file_is_named(llama_folder):
    (llama_folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(llama_folder)


def test_untied_checkpoint_without_lm_head_is_an_error(llama_folder):
    rewrite_weights(llama_folder, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['lm_head\.weight'\]"):
        load_model(llama_folder)


def test_tied_checkpoint_without_lm_head_loads_shared_weights(tmp_path):
    folder = save_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    names = safetensors_torch.load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in names  # the case under test: HF does not store the tied matrix
    model = load_model(folder).model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, names["model.embed_tokens.weight"])


def test_unknown_architecture_is_refused(llama_folder):
    edit_config(llama_folder, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(llama_folder)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5}), "'yarn'"),
    (lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}), "'dynamic'"),
    (lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 2.0, "beta": 1}), r"\['beta'\]"),
    (lambda c: c.update(hidden_act="gelu"), "'gelu'"),
    (lambda c: c.update(mlp_bias=True), "mlp_bias"),
    (lambda c: c.update(use_sliding_window=True), "sliding-window"),
    (lambda c: c.update(layer_types=["sliding_attention"]), "sliding_attention"),
], ids=["rope-yarn", "rope-dynamic-v4", "rope-linear-unknown-key", "gelu", "mlp-bias", "sliding-window",
        "layer-types"])
def test_features_we_do_not_implement_are_refused_not_ignored(llama_folder, edit, match):
    edit_config(llama_folder, edit)
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(llama_folder)


def test_nonexistent_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "no-such-model")


def test_folder_without_safetensors_is_a_clear_error(llama_folder):
    (llama_folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=re.escape("no *.safetensors")):
        load_model(llama_folder)


def test_sharded_index_naming_an_absent_shard_is_an_error(tmp_path):
    folder = tmp_path / "sharded"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    )).save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    load_model(folder)  # the intact sharded folder loads
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=shards[-1].name):
        load_model(folder)


def test_dtype_defaults_to_the_checkpoints_and_can_be_overridden(tmp_path):
    folder = tmp_path / "bf16"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
    )).to(torch.bfloat16).save_pretrained(folder)
    assert load_model(folder).model.dtype == torch.bfloat16
    for dtype in ("float32", torch.float32, "fp32"):
        loaded = load_model(folder, dtype=dtype)
        assert loaded.model.dtype == torch.float32 and loaded.config.torch_dtype == "float32"
    with pytest.raises(InvalidArgumentError, match="'int8'"):
        load_model(folder, dtype="int8")


def test_generation_config_eos_overrides_the_configs(llama_folder):
    edit_config(llama_folder, lambda c: c.update(eos_token_id=3))
    assert load_model(llama_folder).config.eos_token_ids == (3,)
    (llama_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert load_model(llama_folder).config.eos_token_ids == (5, 7)


def test_tokenizer_is_loaded_when_the_folder_has_one(llama_folder):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(llama_folder / "tokenizer.json"))
    loaded = load_model(llama_folder)
    assert loaded.tokenizer is not None and loaded.tokenizer.encode("hello world").ids == [1, 2]


# --- configs -------------------------------------------------------------------------------------------
def test_hf_config_v4_and_v5_keys_read_the_same():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1, eos_token_id=[1, 2])
    v4 = ModelConfig.from_hf_dict(
        {**base, "rope_theta": 500000.0, "rope_scaling": None, "torch_dtype": "bfloat16"}
    )
    v5 = ModelConfig.from_hf_dict(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "dtype": "bfloat16"}
    )
    assert v4 == v5
    assert (v4.rope_theta, v4.torch_dtype, v4.head_dim, v4.eos_token_ids) == (500000.0, "bfloat16", 8, (1, 2))


# the config.json keys of two real checkpoints (transformers 4.x style), values as published
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}
QWEN_2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_real_checkpoint_configs_are_read():
    llama = ModelConfig.from_hf_dict(LLAMA_3_2_1B)
    assert (llama.head_dim, llama.num_queries_per_kv, llama.tie_word_embeddings) == (64, 4, True)
    assert llama.rope_scaling.rope_type == "llama3" and llama.rope_scaling.factor == 32.0
    assert llama.rope_theta == 500000.0 and llama.eos_token_ids == (128001, 128008, 128009)
    qwen = ModelConfig.from_hf_dict(QWEN_2_5_0_5B)
    assert (qwen.head_dim, qwen.attention_bias, qwen.o_proj_bias) == (64, True, False)
    assert qwen.rope_scaling is None
    assert qwen.torch_dtype == "bfloat16" and qwen.rope_theta == 1e6


def test_qwen2_config_turns_on_qkv_biases_only():
    cfg = ModelConfig.from_hf_dict(dict(architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=32,
                                        intermediate_size=48, num_hidden_layers=1, num_attention_heads=4))
    assert (cfg.architecture, cfg.attention_bias, cfg.o_proj_bias) == ("qwen2", True, False)
    assert cfg.num_key_value_heads == 4 and cfg.max_position_embeddings == 32768


@pytest.mark.parametrize("fields, match", [
    (dict(num_attention_heads=4, num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(head_dim=7), "head_dim must be even"),
    (dict(eos_token_id=64), "outside the vocabulary"),
    (dict(torch_dtype="float64"), "dtype must be"),
])
def test_config_validation_names_the_problem(fields, match):
    base = dict(TINY_FIELDS)
    with pytest.raises(InvalidArgumentError, match=match):
        ModelConfig(**{**base, **fields})


def test_from_dict_rejects_unknown_and_missing_keys():
    base = dict(TINY_FIELDS)
    assert ModelConfig.from_dict(ModelConfig.from_dict(base).to_dict()) == ModelConfig.from_dict(base)
    with pytest.raises(InvalidArgumentError, match=r"unknown ModelConfig keys \['hidden'\]"):
        ModelConfig.from_dict({**base, "hidden": 3})
    with pytest.raises(InvalidArgumentError, match=r"missing required keys \['vocab_size'\]"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "vocab_size"})


def test_models_yaml_configs_are_valid_and_named():
    tiny = ModelConfig.from_yaml(MODELS_YAML, "tiny")
    small = ModelConfig.from_yaml(MODELS_YAML, "small")
    assert tiny.num_hidden_layers == 2 and tiny.hidden_size == 64 and tiny.num_key_value_heads == 2
    assert small.hidden_size == 256
    with pytest.raises(InvalidArgumentError, match="no model config 'huge'"):
        ModelConfig.from_yaml(MODELS_YAML, "huge")
    with pytest.raises(InvalidArgumentError, match="pass name="):
        ModelConfig.from_yaml(MODELS_YAML)


# --- random models -------------------------------------------------------------------------------------
def test_random_model_is_seeded_and_the_same_in_every_dtype():
    cfg = ModelConfig.from_yaml(MODELS_YAML, "tiny")
    a, b = load_model(cfg, seed=1).model, load_model(cfg.to_dict(), seed=1).model
    c = load_model(cfg, seed=2).model
    bf = load_model(cfg, seed=1, dtype="bfloat16").model
    for (name, pa), pb, pc, pbf in zip(a.named_parameters(), b.parameters(), c.parameters(), bf.parameters()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
        assert torch.equal(pa.to(torch.bfloat16), pbf), name


# --- attention metadata and backends -------------------------------------------------------------------
def test_attention_metadata_build():
    meta = AttentionMetadata.build(slot_mapping=[8, 9, 10, 3], block_tables=[[2, 5], [0]],
                                   seq_lens=[7, 1], query_lens=[3, 1])
    assert meta.cu_seqlens_q.tolist() == [0, 3, 4] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.block_tables.tolist() == [[2, 5], [0, 0]] and meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64 and meta.seq_lens.tolist() == [7, 1]
    assert (meta.max_query_len, meta.is_decode_only, meta.num_tokens) == (3, False, 4)
    assert meta.last_token_indices().tolist() == [2, 3]
    decode = AttentionMetadata.build(slot_mapping=[1, 2], block_tables=[[0], [1]], seq_lens=[2, 3],
                                     query_lens=[1, 1])
    assert decode.is_decode_only


@pytest.mark.parametrize("kwargs, match", [
    (dict(slot_mapping=[1], block_tables=[[0]], seq_lens=[2], query_lens=[2]), "slot_mapping has 1 entries"),
    (dict(slot_mapping=[1, 2], block_tables=[[0]], seq_lens=[1], query_lens=[2]), "query_len=2, seq_len=1"),
    (dict(slot_mapping=[1], block_tables=[[0], [1]], seq_lens=[1], query_lens=[1]), "block_tables 2"),
])
def test_attention_metadata_build_rejects_inconsistent_lists(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        AttentionMetadata.build(**kwargs)


def test_backend_selection():
    assert isinstance(get_attention_backend("torch"), TorchBackend)
    from pagedbench.kernels import device

    # the CPU default is the batched backend; "torch" stays the per-sequence reference
    assert get_attention_backend(None).name == ("triton" if device.backend().is_gpu else "torch-batched")
    assert get_attention_backend("torch-batched").name == "torch-batched"
    backend = TorchBackend()
    assert get_attention_backend(backend) is backend
    with pytest.raises(InvalidArgumentError,
                       match="unknown attention backend 'cuda'; known: torch, torch-batched, triton"):
        get_attention_backend("cuda")


def test_forward_rejects_a_cache_of_another_dtype():
    cfg = ModelConfig.from_yaml(MODELS_YAML, "tiny")
    model = load_model(cfg, attention_backend="torch").model
    meta = AttentionMetadata.build(slot_mapping=[0], block_tables=[[0]], seq_lens=[1], query_lens=[1])
    cache = torch.zeros(1, 4, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match=re.escape("KV cache dtype torch.bfloat16 differs")):
        model(torch.tensor([1]), torch.tensor([0]), meta, [(cache, cache.clone())] * cfg.num_hidden_layers)
    with pytest.raises(InvalidArgumentError, match=r"must be \[T=1\]"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]), meta, [(cache, cache)] * cfg.num_hidden_layers)
