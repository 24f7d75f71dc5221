"""The engine-built metadata the suite replays: each scenario shows the feature it is named for, the steps
are what the engine's step-input path computes, and a scenario that lost its feature is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from pagedbench.conformance import capabilities
from pagedbench.conformance.adapter import Implementation, NotSupported
from pagedbench.conformance.gate import checks, engine_steps, oracle
from pagedbench.conformance.suite import test_engine_metadata as suite
from pagedbench.conformance.tests import outside_impls


@pytest.mark.parametrize("scenario", engine_steps.SCENARIOS, ids=[s.id for s in engine_steps.SCENARIOS])
def test_scenario_shows_its_feature_and_consistent_metadata(scenario):
    steps = engine_steps.record(scenario)
    bs = scenario.block_size
    for step in steps:
        cu = step.cu_seqlens_q
        assert cu[-1] == len(step.slot_mapping)
        # each token's slot is its position's block in its sequence's row, as the engine's contract says
        for s, (row, n, m) in enumerate(zip(step.block_tables, step.seq_lens, step.query_lens)):
            positions = np.arange(n - m, n)
            want = row[positions // bs].astype(np.int64) * bs + positions % bs
            np.testing.assert_array_equal(step.slot_mapping[cu[s]:cu[s + 1]], want)
        assert step.block_tables.shape[1] == -(-int(step.seq_lens.max()) // bs)  # no spare column


_CHANGES = {  # what takes each scenario's feature away
    "prefix-hit": lambda sc: {"requests": tuple(dataclasses.replace(r, arrival_step=0)
                                                for r in sc.requests)},  # no hit: nothing published yet
    "fork-n3": lambda sc: {"requests": tuple(dataclasses.replace(r, n=1) for r in sc.requests)},
    "preempt-resume": lambda sc: {"num_blocks": 40},
    "chunked-prefill": lambda sc: {"max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("scenario", engine_steps.SCENARIOS, ids=[s.id for s in engine_steps.SCENARIOS])
def test_scenario_without_its_feature_is_refused(scenario):
    with pytest.raises(AssertionError, match=f"no step shows {scenario.feature!r}"):
        engine_steps.record(dataclasses.replace(scenario, **_CHANGES[scenario.name](scenario)))


def test_the_family_reaches_both_attention_calls():
    """The engine sends a step of single-token chunks to paged_decode and any other to paged_prefill; the
    replayed runs hold both kinds, with blocks shared across sequences in each."""
    steps = [s for sc in engine_steps.SCENARIOS for s in engine_steps.record(sc)]
    assert any(s.decode_only and s.shares_blocks for s in steps)
    assert any(not s.decode_only and s.shares_blocks for s in steps)


# --- the suite's replay on implementations of part of the contract ------------------------------------------


class _Parts(Implementation):
    """Pure torch fakes of the operations a replay calls (none from ``pagedbench.kernels``): each subclass
    keeps some and, optionally, breaks one."""

    def _decode(self, q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, out=None, **kwargs):
        return outside_impls.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, None, out)

    def _prefill(self, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale=None, out=None,
                 **kwargs):
        got = oracle.prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale).out.to(q.dtype)
        out = torch.empty_like(q) if out is None else out
        out.copy_(got)
        return out

    def _write(self, k, v, k_cache, v_cache, slot_mapping):
        bs = k_cache.shape[1]
        k_cache[slot_mapping // bs, slot_mapping % bs] = k
        v_cache[slot_mapping // bs, slot_mapping % bs] = v


class _DecodeOnly(_Parts):
    paged_decode = _Parts._decode


class _DecodeOnlyDropsNewest(_Parts):
    """Decode that leaves out each sequence's newest key: right only where the suite is not looking."""

    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, **kwargs):
        return self._decode(q, k_cache, v_cache, block_tables, (seq_lens - 1).clamp(min=1), **kwargs)


class _PrefillOnly(_Parts):
    paged_prefill = _Parts._prefill


class _WriteOnly(_Parts):
    write_kv = _Parts._write


class _WriteOnlyShifted(_Parts):
    """Writes every token one slot on (into a slot no attention of its own would read)."""

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        self._write(k, v, k_cache, v_cache, (slot_mapping + 1) % (k_cache.shape[0] * k_cache.shape[1]))


class _CopyNothing(_Parts):
    """Implements every operation, but its ``copy_blocks`` copies nothing."""

    paged_decode, paged_prefill, write_kv = _Parts._decode, _Parts._prefill, _Parts._write

    def copy_blocks(self, k_cache, v_cache, pairs):
        pass


def _replay(impl_type, scenario, *, may_skip=False):
    impl = impl_type()
    impl.name = impl_type.__name__
    try:
        return suite.replay(impl, suite.EngineCase(scenario))
    except NotSupported as e:  # the test runner would make a skip of it: these tests would then not judge
        raise AssertionError(f"replay let NotSupported out: {e}") from e
    except pytest.skip.Exception as e:
        if may_skip:
            raise
        raise AssertionError(f"replay skipped: {e}") from e


FORKS = [s for s in engine_steps.SCENARIOS if s.name == "fork-n3"]  # copies, decodes and prefills, both block sizes


@pytest.mark.parametrize("scenario", FORKS, ids=[s.id for s in FORKS])
def test_replay_judges_each_implementation_on_the_operations_it_has(scenario):
    steps = engine_steps.record(scenario)
    decodes = sum(s.decode_only for s in steps)
    assert _replay(_DecodeOnly, scenario) == {"paged_decode": decodes}
    assert sorted(capabilities.UNCHECKED[checks._current_test()]) == ["copy_blocks", "paged_prefill", "write_kv"]
    assert _replay(_PrefillOnly, scenario) == {"paged_prefill": len(steps) - decodes}
    assert _replay(_WriteOnly, scenario) == {"write_kv": len(steps)}


@pytest.mark.parametrize(("impl_type", "message"), [
    (_DecodeOnlyDropsNewest, "decode_out: rel error"),  # judged on its decodes, over K/V the suite wrote
    (_WriteOnlyShifted, "k_cache after write_kv: "),  # judged on its cache alone
    (_CopyNothing, "k_cache after copy_blocks: "),
])
@pytest.mark.parametrize("scenario", FORKS, ids=[s.id for s in FORKS])
def test_replay_fails_a_wrong_part(scenario, impl_type, message):
    with pytest.raises(AssertionError, match=message):
        _replay(impl_type, scenario)


def test_replay_of_an_implementation_with_none_of_the_operations_is_not_supported():
    with pytest.raises(pytest.skip.Exception,
                       match=r"^not supported: _Parts implements none of copy_blocks, write_kv, paged_decode, "
                             r"paged_prefill \(NotSupported from each\)$"):
        _replay(_Parts, FORKS[0], may_skip=True)
