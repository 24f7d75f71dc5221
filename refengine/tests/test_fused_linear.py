"""q/k/v and gate/up as one matmul each (``model.fused_linear``): the parts stay the model's parameters as
views of the fused weight, a part replaced is fused again, and tensor parallelism shards each part alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedbench.refengine import AttentionMetadata, load_model
from pagedbench.refengine.model import llama
from pagedbench.refengine.model.fused_linear import fuse
from pagedbench.refengine.parallel.linear import shard_model

BS, NUM_BLOCKS = 4, 8
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, torch_dtype="float32")


def _step(model, seed: int = 0) -> torch.Tensor:
    """Final hidden states [7, hidden] of a 7-token prompt over fresh caches (float64 for a float64 model)."""
    gen = np.random.default_rng(seed)
    cfg, n = model.config, 7
    tables = gen.permutation(NUM_BLOCKS)[:2].astype(np.int32)[None]
    slots = np.array([int(tables[0, p // BS]) * BS + p % BS for p in range(n)])
    meta = AttentionMetadata.from_host(block_tables=tables, seq_lens=np.array([n]), query_lens=np.array([n]),
                                       slot_mapping=slots)
    kv_heads = model.model.layers[0].self_attn.num_kv_heads
    shape = (NUM_BLOCKS, BS, kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
          for _ in range(cfg.num_hidden_layers)]
    ids = torch.from_numpy(gen.integers(0, cfg.vocab_size, n))
    return model(ids, torch.arange(n), meta, kv)


def test_loaded_model_parts_are_views_of_one_weight():
    model = load_model(CONFIG, seed=1).model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    f = attn.qkv_fusion
    assert f is not None and f.split_sizes == (4 * 8, 2 * 8, 2 * 8)
    assert torch.equal(f.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(f.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert attn.k_proj.weight.data_ptr() == f.weight[32:].data_ptr()  # shares the storage: no second copy
    assert mlp.gate_up_fusion.split_sizes == (48, 48)
    assert attn.q_proj.weight.untyped_storage().data_ptr() == f.weight.untyped_storage().data_ptr()
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()  # the checkpoint's names
    assert not any("fusion" in name for name in model.state_dict())
    ptr = attn.q_proj.weight.data_ptr()
    _step(model)  # a forward over parts that are still views keeps their fusion: nothing is copied again
    assert attn.qkv_fusion is f and attn.q_proj.weight.data_ptr() == ptr


@pytest.mark.parametrize("widths,dtypes,biases", [
    ((4, 5), (torch.float32, torch.float32), (False, False)),
    ((4, 4), (torch.float32, torch.float64), (False, False)),
    ((4, 4), (torch.float32, torch.float32), (True, False)),
], ids=["input-widths", "dtypes", "bias-on-one"])
def test_layers_that_cannot_share_one_matmul_are_left_as_they_are(widths, dtypes, biases):
    layers = [torch.nn.Linear(w, 3, bias=b, dtype=t) for w, t, b in zip(widths, dtypes, biases)]
    weights = [layer.weight for layer in layers]
    assert fuse(layers) is None
    assert all(layer.weight is w and layer.weight.dtype == t for layer, w, t in zip(layers, weights, dtypes))


def test_fused_step_matches_separate_matmuls():
    model = load_model(CONFIG, seed=2).model.to(torch.float64)  # float64: any reordering stays far below 1e-12
    fused = _step(model)
    original = llama.fused
    llama.fused = lambda current, layers: None  # every layer on its separate projections
    try:
        separate = _step(model)
    finally:
        llama.fused = original
    torch.testing.assert_close(fused, separate, rtol=1e-12, atol=1e-12)


def test_in_place_write_to_a_part_reaches_the_fused_matmul():
    model = load_model(CONFIG, seed=3).model
    before = _step(model)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.mul_(2.0)  # what a checkpoint load does: copy_ in place
        model.model.layers[1].mlp.up_proj.weight.mul_(-1.0)
    after = _step(model)
    reference = load_model(CONFIG, seed=3).model
    with torch.no_grad():
        reference.model.layers[1].self_attn.v_proj.weight.mul_(2.0)
        reference.model.layers[1].mlp.up_proj.weight.mul_(-1.0)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, _step(reference), rtol=0, atol=0)


def test_replaced_parts_are_fused_again():
    model = load_model(CONFIG, seed=4).model.to(torch.float64)  # every parameter a new tensor
    attn = model.model.layers[0].self_attn
    assert not attn.qkv_fusion.current((attn.q_proj, attn.k_proj, attn.v_proj))
    out = _step(model)
    assert attn.qkv_fusion.weight.dtype == torch.float64
    assert attn.qkv_fusion.current((attn.q_proj, attn.k_proj, attn.v_proj))
    torch.testing.assert_close(out.to(torch.float32), _step(load_model(CONFIG, seed=4).model), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_shards_each_part_by_heads_then_fuses():
    full = load_model(CONFIG, seed=5).model
    q, k, v = (getattr(full.model.layers[0].self_attn, f"{p}_proj").weight.clone() for p in "qkv")
    gate, up = full.model.layers[0].mlp.gate_proj.weight.clone(), full.model.layers[0].mlp.up_proj.weight.clone()
    shard_model(full, rank=1, world_size=2, all_reduce=lambda t: None)
    attn, mlp = full.model.layers[0].self_attn, full.model.layers[0].mlp
    d = 8  # head_dim: rank 1 holds query heads 2-3 and KV head 1 of each of k and v
    expected = torch.cat([q[2 * d:4 * d], k[d:2 * d], v[d:2 * d]])
    assert attn.qkv_fusion.split_sizes == (2 * d, d, d)
    assert torch.equal(attn.qkv_fusion.weight, expected)
    assert torch.equal(mlp.gate_up_fusion.weight, torch.cat([gate[24:], up[24:]]))
    assert attn.v_proj.weight.data_ptr() == attn.qkv_fusion.weight[3 * d:].data_ptr()
