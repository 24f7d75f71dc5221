"""The host link's price of KV block copies (bench/costmodel/host_link.py), checked by hand, and every GPU
profile's link."""

from __future__ import annotations

import pytest
from pagedbench.bench.costmodel import load_hardware, load_model
from pagedbench.bench.costmodel.hardware import hardware_names
from pagedbench.bench.costmodel.host_link import BlockCopyCost, HostLink, host_link, kv_bytes_per_block


@pytest.mark.parametrize(("tp", "kv_heads_per_gpu"), [(1, 40), (4, 10)])
def test_one_opt_13b_block_on_an_a100_by_hand(tp, kv_heads_per_gpu):
    # OPT-13B: 40 layers, 40 KV heads of 128, fp16; a block of 16 tokens, K and V in every layer
    bytes_per_block = 16 * 2 * 40 * kv_heads_per_gpu * 128 * 2
    assert bytes_per_block == 13_107_200 // tp
    cost = BlockCopyCost.of(load_model("opt-13b"), load_hardware("a100-40gb"), 16, tensor_parallel_size=tp)
    assert cost.bytes_per_block == bytes_per_block
    # PCIe Gen4 x16 at 25 GB/s, 5 us a transfer, one transfer per layer for K and one for V (vLLM v0)
    by_hand = bytes_per_block / 25e9 + 2 * 40 * 5e-6
    assert cost.block_s == pytest.approx(by_hand, rel=1e-12)
    assert cost(1, 0) == cost(0, 1) == pytest.approx(by_hand, rel=1e-12)
    assert cost(3, 2) == pytest.approx(5 * by_hand, rel=1e-12)  # out then in, one copy stream
    assert cost.load_s(2) == pytest.approx(2 * by_hand, rel=1e-12)


def test_the_per_layer_layout_pays_its_transfers_once_a_step():
    model, a100 = load_model("opt-13b"), load_hardware("a100-40gb")
    batched = BlockCopyCost.of(model, a100, 16, layout="per_layer")
    assert batched.step_s(10) == pytest.approx(10 * 13_107_200 / 25e9 + 80 * 5e-6, rel=1e-12)
    assert batched.step_s(1) == pytest.approx(BlockCopyCost.of(model, a100, 16).step_s(1), rel=1e-12)
    assert batched.step_s(0) == 0.0


def test_a_transfer_is_latency_plus_bytes_over_bandwidth():
    link = HostLink("x", 1e9, 2e-6)
    assert link.transfer_s(1000, 3) == pytest.approx(3 * 2e-6 + 1e-6, rel=1e-12)
    with pytest.raises(ValueError, match="num_bytes must be an int >= 0, got -1"):
        link.transfer_s(-1)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        kv_bytes_per_block(load_model("opt-13b"), 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        BlockCopyCost(link, 16, 1, 1, "per_token")


@pytest.mark.parametrize("name", hardware_names())
def test_every_gpu_profile_has_its_pcie_link(name):
    expected = {"a100-40gb": "pcie_gen4_x16", "a100-80gb": "pcie_gen4_x16", "l4": "pcie_gen4_x16",
                "h100-sxm": "pcie_gen5_x16", "h200": "pcie_gen5_x16"}
    link = host_link(load_hardware(name))
    assert link.name == expected[name]
    # the achievable share of one direction's raw rate (31.5 GB/s Gen4, 63 GB/s Gen5)
    raw = 31.5e9 if link.name == "pcie_gen4_x16" else 63e9
    assert 0.5 * raw < link.bandwidth_bytes_per_s < raw
    assert 0 < link.latency_s < 1e-4
