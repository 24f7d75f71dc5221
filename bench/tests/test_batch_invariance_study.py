"""The batch-invariance and load-speed studies on tiny inputs: their records and tables are written, the
invariant mode's logits are the same alone and in the batch, and a missing checkpoint is a skipped line."""

from __future__ import annotations

import json

import pytest
from pagedbench.bench.studies.batch_invariance import study as batch_invariance
from pagedbench.bench.studies.load_speed import study as load_speed
from pagedbench.refengine import ModelConfig, load_model

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
             "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 64, "torch_dtype": "float32"}


def test_batch_invariance_measures_both_modes(tmp_path, monkeypatch):
    case = batch_invariance.Case("tiny", "tiny", 2, 12, 2, 8, 1)
    monkeypatch.setattr(batch_invariance, "CASES", (case,))
    batch_invariance.main(["--out", str(tmp_path)])
    (r,) = json.loads((tmp_path / "batch_invariance.json").read_text())["results"]
    assert r["alone_equals_beside"] and r["rounds"] == 1 and r["ratio"] > 0
    assert r["default_s"] > 0 and r["invariant_s"] > 0 and 0 <= r["same_tokens"] <= 2
    assert "| tiny " in (tmp_path / "batch_invariance.md").read_text()


def test_load_speed_times_a_folder_and_skips_without_one(tmp_path, monkeypatch):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    model = load_model(ModelConfig.from_hf_dict(HF_CONFIG), attention_backend="torch", seed=0).model
    safetensors_torch.save_file(model.state_dict(), str(folder / "model.safetensors"))
    r = load_speed.measure(folder)
    assert r["weight_bytes"] == (folder / "model.safetensors").stat().st_size
    assert r["read_s"] > 0 and r["build_s"] > 0 and r["ratio"] > 0
    monkeypatch.setattr(load_speed, "SMOLLM2_DIR", tmp_path / "absent")
    load_speed.main(["--out", str(tmp_path)])
    assert "skipped" in json.loads((tmp_path / "load_speed.json").read_text())["result"]
