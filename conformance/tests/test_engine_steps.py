"""The engine-built metadata the suite replays: each scenario shows the feature it is named for, the steps
are what the engine's step-input path computes, and a scenario that lost its feature is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pagedbench.conformance.gate import engine_steps


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


def _without_feature(scenario: engine_steps.EngineScenario) -> dict:
    """The change to ``scenario`` that takes its feature away."""
    return {
        "prefix-hit": {"requests": tuple(dataclasses.replace(r, arrival_step=0)
                                         for r in scenario.requests)},  # no hit: nothing published yet
        "fork": {"requests": tuple(dataclasses.replace(r, n=1) for r in scenario.requests)},
        "preempt": {"num_blocks": 40},
        "chunked": {"max_num_batched_tokens": 64},
    }[scenario.feature]


@pytest.mark.parametrize("scenario", engine_steps.SCENARIOS, ids=[s.id for s in engine_steps.SCENARIOS])
def test_scenario_without_its_feature_is_refused(scenario):
    with pytest.raises(AssertionError, match=f"no step shows {scenario.feature!r}"):
        engine_steps.record(dataclasses.replace(scenario, **_without_feature(scenario)))


def test_each_feature_comes_with_blocks_of_4_and_of_16():
    """Blocks of 16 for the kernels that take only multiples of 16 (vLLM's), each feature in both sets."""
    for scenarios, bs in ((engine_steps.SCENARIOS_BS4, 4), (engine_steps.SCENARIOS_BS16, 16)):
        assert sorted(s.feature for s in scenarios) == sorted(engine_steps.FEATURES)
        assert {s.block_size for s in scenarios} == {bs}


def test_the_family_reaches_both_attention_calls():
    """The engine sends a step of single-token chunks to paged_decode and any other to paged_prefill; the
    replayed runs hold both kinds, with blocks shared across sequences in each."""
    for scenarios in (engine_steps.SCENARIOS_BS4, engine_steps.SCENARIOS_BS16):
        steps = [s for sc in scenarios for s in engine_steps.record(sc)]
        assert any(s.decode_only and s.shares_blocks for s in steps)
        assert any(not s.decode_only and s.shares_blocks for s in steps)
