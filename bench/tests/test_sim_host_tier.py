"""The prefix cache's host tier in the serving simulator (``SimConfig(offload_blocks=N)``): the real block
manager with ``num_host_blocks`` serves the same completions as without, loads back the shared prefix the
device tier evicts (computed tokens lower by exactly the host hits), each step's stores and loads priced
over the host link, and the default path unchanged."""

from __future__ import annotations

import dataclasses

import pytest
from pagedbench.bench.costmodel.host_link import BlockCopyCost, HostLink
from pagedbench.bench.sim.run import SimRun
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, constant_step, simulate
from pagedbench.bench.workloads import Request, synthetic
from pagedbench.refengine import BlockManager

PAGED = AllocatorSpec("paged", 16)
SHARED = [(7 * i + 3) % 30_000 + 1 for i in range(256)]  # 16 blocks every even request starts with
NUM_PAIRS = 6
STEP_S = 0.02


def _evicting_trace() -> tuple[tuple[Request, ...], dict[int, list[int]]]:
    """Pairs served one at a time, all arriving at 0: a prompt with the shared prefix (18 blocks), then one of
    1000 unique tokens that needs 63 of the pool's 64 blocks, evicting every cached block but the one freed
    last (LRU): the prefix's first block stays on the device, its other 15 are evicted."""
    trace, tokens = [], {}
    for i in range(NUM_PAIRS):
        a, b = 2 * i, 2 * i + 1
        tokens[a] = SHARED + [40_000 + 32 * a + j for j in range(32)]
        tokens[b] = [100_000 + 1000 * b + j for j in range(1000)]
        trace += [Request(a, len(tokens[a]), 8), Request(b, len(tokens[b]), 8)]
    return tuple(trace), tokens


def _cfg(offload_blocks: int | None) -> SimConfig:
    return SimConfig(kv_slots=64 * 16, max_seq_len=1024, max_num_seqs=1, enable_prefix_caching=True,
                     offload_blocks=offload_blocks)


def _run(offload_blocks: int | None, block_copy_s=None, **kw):
    trace, tokens = _evicting_trace()
    step = constant_step(STEP_S)
    if block_copy_s is not None:
        step.block_copy_s = block_copy_s
    return simulate(trace, PAGED, _cfg(offload_blocks), step_time_s=step, account=False,
                    prompt_tokens=lambda r: tokens[r.request_id], **kw)


def test_the_host_tier_serves_the_same_completions_and_loads_what_the_device_evicted():
    device, host = _run(None), _run(512)
    for r in (device, host):
        assert r.num_finished == 2 * NUM_PAIRS and all(t.finished for t in r.requests)
    assert [(t.request_id, len(t.token_times_s)) for t in device.requests] == \
        [(t.request_id, len(t.token_times_s)) for t in host.requests]
    assert device.num_generated_tokens == host.num_generated_tokens == 8 * 2 * NUM_PAIRS
    # every later prompt with the shared prefix finds its first block on the device and loads the other 15
    # (240 tokens) back from the host
    assert device.prefix_hit_tokens == (NUM_PAIRS - 1) * 16
    assert host.prefix_host_hit_tokens == (NUM_PAIRS - 1) * 240
    assert host.num_offload_loaded_blocks == (NUM_PAIRS - 1) * 15
    assert host.num_offload_stored_blocks > 0 and device.num_offload_stored_blocks == 0
    assert device.prefix_host_hit_tokens == 0 and device.host_cached_tokens == ()
    assert host.prefix_hit_tokens == device.prefix_hit_tokens  # the device tier's hits are the same
    assert host.prefix_computed_tokens == device.prefix_computed_tokens - host.prefix_host_hit_tokens
    # per request: 240 of the prefix's tokens loaded at each later even request's admission, nothing else
    assert dict(host.host_cached_tokens) == {i: 240 if i % 2 == 0 and i > 0 else 0 for i in range(2 * NUM_PAIRS)}
    assert dict(host.cached_tokens) == {i: 256 if i % 2 == 0 and i > 0 else 0 for i in range(2 * NUM_PAIRS)}
    assert dict(device.cached_tokens) == {i: 16 if i % 2 == 0 and i > 0 else 0 for i in range(2 * NUM_PAIRS)}


def test_a_block_loaded_once_is_the_loaders_host_hit_and_a_device_hit_for_the_next():
    # the prefix computed, evicted, then two prompts with it admitted in one step: the first loads the 15
    # evicted blocks from the host, the second finds them published on the device
    trace, tokens = _evicting_trace()
    trace = tuple(dataclasses.replace(r, arrival_s=t) for r, t in zip(trace[:3] + trace[4:5], (0.0, 1.0, 2.0, 2.0)))
    cfg = dataclasses.replace(_cfg(512), max_num_seqs=2)
    r = simulate(trace, PAGED, cfg, step_time_s=constant_step(STEP_S), account=False,
                 prompt_tokens=lambda r: tokens[r.request_id])
    assert dict(r.cached_tokens) == {0: 0, 1: 0, 2: 256, 4: 256}
    assert dict(r.host_cached_tokens) == {0: 0, 1: 0, 2: 240, 4: 0}
    assert r.prefix_host_hit_tokens == 240 and r.num_offload_loaded_blocks == 15
    assert r.prefix_hit_tokens == 16 + 256


def test_host_tier_copies_are_priced_stores_out_and_loads_in():
    def price(num_out: int, num_in: int) -> float:
        return 1e-3 * num_out + 3e-3 * num_in  # a load costs three stores: the directions stay apart

    priced, free = _run(512, price), _run(512)
    loads = [c for c in priced.copies if c.num_offload_loaded]
    assert len(loads) == NUM_PAIRS - 1 and all(c.num_offload_loaded == 15 for c in loads)
    for c in priced.copies:
        assert (c.num_swapped_out, c.num_swapped_in) == (0, 0)
        assert c.copy_s == pytest.approx(1e-3 * c.num_offload_stored + 3e-3 * c.num_offload_loaded)
    assert sum(c.num_offload_stored for c in priced.copies) == priced.num_offload_stored_blocks
    assert priced.copy_s == pytest.approx(1e-3 * priced.num_offload_stored_blocks
                                          + 3e-3 * priced.num_offload_loaded_blocks)
    # every arrival at 0, nothing idle: the same steps, each copying one longer by its price
    assert priced.num_steps == free.num_steps and free.copy_s == 0.0
    assert priced.simulated_s - free.simulated_s == pytest.approx(priced.copy_s)


def test_a_step_with_loads_lasts_longer_by_their_host_link_price():
    # 25 GB/s, 10 us a transfer; a block of 32 layers' K and V (64 transfers, 128 KiB): per block
    # 64 * 1e-5 + 131072 / 25e9 = 6.4e-4 + 5.24288e-6 s, in either direction
    cost = BlockCopyCost(HostLink("test link", 25e9, 1e-5), 16, 131_072, 32)
    per_block = 6.4524288e-4
    priced, free = _run(512, cost), _run(512)
    first = next(c for c in priced.copies if c.num_offload_loaded)
    assert first.copy_s == pytest.approx(per_block * (first.num_offload_stored + 15), rel=1e-12)
    assert priced.simulated_s - free.simulated_s == pytest.approx(
        per_block * (priced.num_offload_stored_blocks + priced.num_offload_loaded_blocks), rel=1e-9)


def _old_manager(spec: AllocatorSpec, cfg: SimConfig) -> BlockManager:
    """The paged manager as the simulator built it before the host tier existed."""
    return BlockManager(cfg.kv_slots // spec.block_size, spec.block_size,
                        enable_prefix_caching=cfg.enable_prefix_caching)


def _old_fields(r) -> dict:
    new = {"prefix_hit_tokens", "prefix_host_hit_tokens", "prefix_computed_tokens", "num_offload_stored_blocks",
           "num_offload_loaded_blocks", "host_cached_tokens"}
    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name not in new}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_without_a_tier_the_run_is_the_old_one(prefix_caching):
    trace = synthetic("sharegpt", 50, rate=30.0, seed=3, max_seq_len=1024)
    base = SimConfig(kv_slots=3000, max_seq_len=1024, enable_prefix_caching=prefix_caching)
    old = simulate(trace, PAGED, base, make_manager=_old_manager)
    assert SimRun(trace, PAGED, base, constant_step(0.04), False, False, None, fast_forward=True).fast is not None
    for cfg in (base, dataclasses.replace(base, offload_blocks=0), dataclasses.replace(base, offload_blocks=None)):
        r = simulate(trace, PAGED, cfg)
        assert _old_fields(r) == _old_fields(old)
        assert r.copies == () and r.num_offload_stored_blocks == r.num_offload_loaded_blocks == 0
        assert r.prefix_host_hit_tokens == 0 and r.host_cached_tokens == ()


def test_the_tier_turns_the_fast_forward_off():
    trace, tokens = _evicting_trace()
    run = SimRun(trace, PAGED, _cfg(512), constant_step(STEP_S), False, False, lambda r: tokens[r.request_id],
                 fast_forward=True)
    assert run.fast is None and run.bm.host_tier is not None and run.bm.host_tier.num_blocks == 512


def test_bad_host_tiers_are_refused():
    with pytest.raises(ValueError, match=r"offload_blocks must be an int >= 0 \(or None\), got -1"):
        SimConfig(enable_prefix_caching=True, offload_blocks=-1)
    with pytest.raises(ValueError, match=r"offload_blocks must be an int >= 0 \(or None\), got 2\.5"):
        SimConfig(enable_prefix_caching=True, offload_blocks=2.5)
    with pytest.raises(ValueError, match="offload_blocks=8 is a host tier of the prefix cache: it needs "
                                         "enable_prefix_caching=True"):
        SimConfig(offload_blocks=8)
    trace = synthetic("alpaca", 4, rate=1.0)
    cfg = SimConfig(enable_prefix_caching=True, offload_blocks=8)
    with pytest.raises(ValueError, match=r"offload_blocks \(the prefix cache's host tier\) needs the paged "
                                         r"manager, got Orca \(Oracle\)"):
        simulate(trace, AllocatorSpec("orca", 1, "oracle"), cfg)
    with pytest.raises(ValueError, match="offload_blocks=8 but the KV manager make_manager built has no host tier"):
        simulate(trace, PAGED, cfg, make_manager=_old_manager)
