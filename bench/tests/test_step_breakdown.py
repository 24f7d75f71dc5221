"""The step breakdown times the engine's own forward and attention calls, per step, and leaves the
engine as it found it."""

from __future__ import annotations

import pytest
from pagedbench.bench.common.step_breakdown import measure
from pagedbench.refengine import LLM, ModelConfig, SamplingParams
from pagedbench.refengine.cli import named_configs_path


@pytest.mark.parametrize("allocator", ["paged", "contiguous"])
def test_the_breakdown_counts_every_layers_attention_and_adds_up(allocator):
    config = ModelConfig.from_yaml(named_configs_path(), name="tiny")
    llm = LLM(config, seed=0, allocator=allocator)
    prompts = [[1 + i, 2, 3, 4, 5] for i in range(3)]
    b = measure(llm, prompts, SamplingParams(max_tokens=4, ignore_eos=True), cuda=False)
    assert b.steps >= 4  # a prefill step and three decode steps at least
    assert 0 < b.attention_ms < b.forward_ms < b.step_ms
    assert b.rest_ms + b.attention_ms == pytest.approx(b.forward_ms)
    assert b.host_ms + b.forward_ms == pytest.approx(b.step_ms)
    assert "run_model" not in vars(llm.executor) and "forward" not in vars(llm.model.attention_backend)
    # the engine serves on, untimed, with the same tokens as an engine never wrapped
    again = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    fresh = LLM(config, seed=0, allocator=allocator).generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True),
                                                               use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]


def test_every_layer_call_is_timed():
    from pagedbench.bench.common import step_breakdown

    config = ModelConfig.from_yaml(named_configs_path(), name="tiny")
    llm = LLM(config, seed=0)
    timers = []
    real = step_breakdown.Timer

    class Counting(real):
        def __init__(self, cuda):
            super().__init__(cuda)
            timers.append(self)

    step_breakdown.Timer = Counting
    try:
        b = measure(llm, [[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), cuda=False)
    finally:
        step_breakdown.Timer = real
    forward, attention = timers
    assert forward.calls == b.steps and attention.calls == b.steps * config.num_hidden_layers
