"""A step with host-tier copies in flight is a transaction too: a fault at any step and seam (the engine's,
and just before the store or the load between the pools) changes no token, and leaves nothing leaked or
pinned on the device or in the host tier; no block whose load may not have run is ever hit."""

from __future__ import annotations

import pytest
from pagedbench.refengine import load_model
from pagedbench.refengine.engine import model_executor
from pagedbench.refengine.engine.leak_check import check_no_leak
from pagedbench.refengine.tests.test_engine_faults import MODEL, Fault, fail_at_every_step, plant, serve
from pagedbench.refengine.tests.test_prefix_offload import gib, make_llm, offload_workload

# (no copy-on-write here: the copy seam is test_engine_faults')
SEAMS = ("planning", "forward", "mid-forward", "update", "mid-update", "offload-store", "offload-load")


def workload():
    """The shared prefix, a prompt that evicts it, the shared prefix again (a host hit), then a fourth."""
    prompts, params = offload_workload()
    return prompts[:4], params[:4]


def plant_copy(host_pool, side: str, fault: Fault, monkeypatch) -> None:
    """The fault just before a copy whose ``side`` ("src" or "dst") is ``host_pool``: that copy never ran."""
    real = model_executor.copy_blocks_between
    host_k = host_pool.kv_caches()[0][0]

    def copy(src, dst, pairs):
        if pairs and (dst if side == "dst" else src)[0][0] is host_k:
            fault.hit()
        real(src, dst, pairs)
    monkeypatch.setattr(model_executor, "copy_blocks_between", copy)


def plant_offload(llm, seam: str, fault: Fault, monkeypatch) -> None:
    if seam not in ("offload-store", "offload-load"):
        plant(llm, seam, fault, monkeypatch)
        return
    plant_copy(llm.offload_pool, "dst" if seam == "offload-store" else "src", fault, monkeypatch)


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, attention_backend="torch-batched", seed=1)


@pytest.fixture(scope="module")
def fault_free(loaded):
    prompts, params = workload()
    want, _ = serve(make_llm(loaded), prompts, params)  # without the tier
    llm = make_llm(loaded, kv_offloading_size=gib(32))
    got, steps = serve(llm, prompts, params)
    assert got == want and llm.stats.prefix_host_hit_tokens > 0
    return want, steps


@pytest.mark.parametrize("seam", SEAMS)
def test_a_failed_step_with_host_tier_copies_leaks_nothing_and_changes_no_token(loaded, fault_free, seam,
                                                                               monkeypatch):
    want, num_steps = fault_free
    prompts, params = workload()
    fired = fail_at_every_step(lambda: make_llm(loaded, kv_offloading_size=gib(32)),
                               lambda llm, fault: plant_offload(llm, seam, fault, monkeypatch), prompts, params,
                               want, num_steps, seam, after=lambda llm: check_no_leak(llm.block_manager, llm.scheduler))
    assert fired >= 1, f"the {seam} fault never fired"


def test_a_host_hit_whose_load_failed_is_loaded_again_not_hit_on_the_device(loaded, monkeypatch):
    """The load of the shared prefix fails once: the retried admission must load it again (the device
    blocks of the failed load were unpublished), and the tokens stay those of a fault-free run."""
    prompts, params = workload()
    want, _ = serve(make_llm(loaded), prompts, params)
    llm = make_llm(loaded, kv_offloading_size=gib(32))
    fault = Fault()
    plant_offload(llm, "offload-load", fault, monkeypatch)
    fault.armed = True  # the first step with a load fails (serve leaves the fault alone: none given)
    got, _ = serve(llm, prompts, params)
    assert fault.fired == 1 and got == want
    st = llm.stats  # (a re-admission is looked up again and counted again, as every re-admission)
    assert st.prefix_hit_tokens == 0, "a block whose load failed was hit on the device"
    assert st.prefix_host_hit_tokens == 2 * 16, "the failed load was not redone"
