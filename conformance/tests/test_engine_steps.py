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


@pytest.mark.parametrize("name,change", [
    ("prefix-hit", {"requests": tuple(dataclasses.replace(r, arrival_step=0)
                                      for r in engine_steps.SCENARIOS[0].requests)}),  # no hit: nothing published
    ("fork-n3", {"requests": tuple(dataclasses.replace(r, n=1) for r in engine_steps.SCENARIOS[2].requests)}),
    ("preempt-resume", {"num_blocks": 40}),
    ("chunked-prefill", {"max_num_batched_tokens": 64}),
])
def test_scenario_without_its_feature_is_refused(name, change):
    scenario = next(s for s in engine_steps.SCENARIOS if s.name == name)
    with pytest.raises(AssertionError, match=f"no step shows {scenario.feature!r}"):
        engine_steps.record(dataclasses.replace(scenario, **change))


def test_the_family_reaches_both_attention_calls():
    """The engine sends a step of single-token chunks to paged_decode and any other to paged_prefill; the
    replayed runs hold both kinds, with blocks shared across sequences in each."""
    steps = [s for sc in engine_steps.SCENARIOS for s in engine_steps.record(sc)]
    assert any(s.decode_only and s.shares_blocks for s in steps)
    assert any(not s.decode_only and s.shares_blocks for s in steps)
