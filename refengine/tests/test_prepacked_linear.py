"""The prepacked oneDNN linear path (``model.prepacked_linear``): its output against float64, a packed copy
that follows its weight (written in place or replaced), the per-site choice, and the engine on it."""

from __future__ import annotations

import pytest
import torch
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.model import prepacked_linear
from pagedbench.refengine.model.prepacked_linear import SITES, LinearPath, choose_paths, onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, torch_dtype="float32")
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}  # of max |float64 result|


def _onednn_path(weight):
    path = LinearPath()
    path.use(True, weight)
    return path


def _rel_error(out, x, weight, bias):
    ref = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_packed_path_matches_float64(dtype, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(40, 24, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 24, generator=gen).to(dtype)
    path = _onednn_path(weight)
    out = path(x, weight, bias)
    assert out.shape == (rows, 40) and out.dtype == dtype
    assert _rel_error(out, x, weight, bias) < TOL[dtype]


def test_no_rows_give_an_empty_result():
    weight = torch.randn(8, 4)
    assert _onednn_path(weight)(torch.randn(0, 4), weight, None).shape == (0, 8)


def test_a_weight_written_in_place_is_packed_again():
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(16, 8, generator=gen), torch.randn(3, 8, generator=gen)
    path = _onednn_path(weight)
    path(x, weight, None)
    with torch.no_grad():
        weight.copy_(torch.randn(16, 8, generator=gen))  # what a checkpoint load does
    assert _rel_error(path(x, weight, None), x, weight, None) < TOL[torch.float32]


def test_a_replaced_weight_is_packed_again():
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(16, 8, generator=gen), torch.randn(3, 8, generator=gen)
    path = _onednn_path(weight)
    other = torch.randn(16, 8, generator=gen)
    assert _rel_error(path(x, other, None), x, other, None) < TOL[torch.float32]


def test_weights_onednn_cannot_take_stay_on_f_linear():
    weight = torch.randn(8, 4, dtype=torch.float64)
    path = _onednn_path(weight)
    x = torch.randn(2, 4, dtype=torch.float64)
    assert torch.equal(path(x, weight, None), torch.nn.functional.linear(x, weight))
    assert choose_paths({"o": (weight, None)}, "onednn") == {"o": {"path": "torch"}}


def test_the_modes_choose_as_they_say():
    weight = torch.randn(32, 16)
    assert choose_paths({"o": (weight, None)}, "torch") == {"o": {"path": "torch"}}
    assert choose_paths({"o": (weight, None)}, "onednn") == {"o": {"path": "onednn"}}
    auto = choose_paths({"o": (weight, None)}, "auto")["o"]
    assert auto["path"] == ("onednn" if auto["speedup"] >= prepacked_linear.MIN_SPEEDUP else "torch")
    assert auto["torch_ms"] > 0 and auto["onednn_ms"] > 0
    # measured once per shape, dtype and thread count: a second engine in the process runs the same arithmetic
    assert choose_paths({"o": (torch.randn(32, 16), None)}, "auto")["o"] == auto
    with pytest.raises(InvalidArgumentError, match="linear_path must be one of"):
        choose_paths({"o": (weight, None)}, "mkl")


def test_the_model_applies_the_choice_to_every_layer():
    model = load_model(CONFIG, seed=1).model
    chosen = model.set_linear_paths("onednn")
    assert set(chosen) == set(SITES) and all(c["path"] == "onednn" for c in chosen.values())
    for layer in model.model.layers:
        for path in (layer.self_attn.qkv_path, layer.self_attn.o_path, layer.mlp.gate_up_path, layer.mlp.down_path):
            assert path.onednn
    assert model.lm_head_path.onednn
    model.set_linear_paths("torch")
    assert not model.model.layers[1].mlp.down_path.onednn and not model.lm_head_path.onednn


def test_the_engine_gives_the_same_tokens_and_close_logprobs_on_either_path():
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38, 32]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    results = {}
    for mode in ("torch", "onednn"):
        llm = LLM(CONFIG, seed=3, num_blocks=32, block_size=4, linear_path=mode)
        assert all(c["path"] == mode for c in llm.linear_paths.values())
        results[mode] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(results["torch"], results["onednn"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lb = [lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert la == pytest.approx(lb, abs=1e-4)


def test_the_engine_refuses_an_unknown_linear_path():
    with pytest.raises(InvalidArgumentError, match="linear_path must be one of"):
        LLM(CONFIG, num_blocks=8, block_size=4, linear_path="fast")


def test_the_engine_refuses_onednn_with_tensor_parallel_ranks():
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size=1 only"):
        LLM(CONFIG, num_blocks=8, block_size=4, linear_path="onednn", tensor_parallel_size=2)


def test_every_site_of_a_forward_runs_through_its_path(monkeypatch):
    llm = LLM(CONFIG, seed=3, num_blocks=32, block_size=4, linear_path="onednn")
    called = []
    real = LinearPath.__call__
    monkeypatch.setattr(LinearPath, "__call__", lambda self, *a: called.append(self) or real(self, *a))
    llm.generate([[3, 14, 15]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    model = llm.model
    sites = [p for layer in model.model.layers for p in (layer.self_attn.qkv_path, layer.self_attn.o_path,
                                                        layer.mlp.gate_up_path, layer.mlp.down_path)]
    assert all(any(c is p for c in called) for p in [*sites, model.lm_head_path])
