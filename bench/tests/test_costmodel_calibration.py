"""fit_profile recovers known coefficients from synthetic steps, keeps costs >= 0, refuses bad samples."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from pagedbench.bench.costmodel.batched_cost import (
    BATCHED_TERMS,
    AttentionGroup,
    BatchedStepCost,
    attention_groups,
    batched_term_row,
)
from pagedbench.bench.costmodel.calibration import (
    StepSample,
    fit_batched_profile,
    fit_profile,
    relative_errors,
    term_identifiability,
)
from pagedbench.bench.costmodel.step_cost import StepBatch, StepCostModel

TRUTH = StepCostModel(label="truth", fixed_s=3e-3, linear_weights_s=0.0, linear_mem_s_per_token=0.0,
                      linear_compute_s_per_token=2e-4, lm_head_s_per_sampled_token=5e-5,
                      decode_attn_s_per_context_token=1e-7, prefill_attn_s_per_kv_token=0.0,
                      prefill_attn_s_per_pair=2e-9)


def _batches(n: int, seed: int = 0) -> list[StepBatch]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        decode = tuple(rng.randint(1, 2000) for _ in range(rng.randint(0, 64)))
        chunks = tuple((rng.randint(1, 512), rng.choice([0, 0, rng.randint(1, 1500)]))
                       for _ in range(rng.randint(0 if decode else 1, 3)))
        out.append(StepBatch.of(decode, chunks))
    return out


def _fields(cost: StepCostModel) -> dict[str, float]:
    return {f.name: getattr(cost, f.name) for f in dataclasses.fields(cost) if f.name != "label"}


def test_fit_recovers_known_coefficients_exactly():
    samples = [StepSample(b, TRUTH.step_time_s(b)) for b in _batches(60)]
    fitted = fit_profile(samples)
    for name, value in _fields(TRUTH).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6, abs=1e-15), name
    assert np.abs(relative_errors(fitted, samples)).max() < 1e-9


def test_fit_with_noise_stays_close():
    rng = np.random.default_rng(1)
    samples = [StepSample(b, TRUTH.step_time_s(b) * (1 + 0.02 * rng.standard_normal()))
               for b in _batches(200)]
    fitted = fit_profile(samples)
    assert fitted.fixed_s == pytest.approx(TRUTH.fixed_s, rel=0.1)
    assert fitted.linear_compute_s_per_token == pytest.approx(TRUTH.linear_compute_s_per_token, rel=0.1)
    # Context tokens grow with decode sequences, which share the per-token and per-sampled terms: the
    # attention term is the least determined one under noise.
    assert fitted.decode_attn_s_per_context_token == pytest.approx(
        TRUTH.decode_attn_s_per_context_token, rel=0.35)
    assert np.abs(relative_errors(fitted, samples)).mean() < 0.03


def test_unexercised_term_is_zero():
    batches = [b for b in _batches(120) if not b.prefill_chunks]  # decode only: no prefill attention
    fitted = fit_profile([StepSample(b, TRUTH.step_time_s(b)) for b in batches])
    assert fitted.prefill_attn_s_per_pair == 0.0


def test_no_cost_comes_back_negative():
    # Timings where longer contexts look slightly cheaper (a measurement artefact) must not give a
    # negative attention cost, which would make a simulator's longer steps faster.
    truth = dataclasses.replace(TRUTH, decode_attn_s_per_context_token=-2e-8)
    fitted = fit_profile([StepSample(b, truth.step_time_s(b)) for b in _batches(120)])
    assert all(v >= 0 for v in _fields(fitted).values()), _fields(fitted)
    assert fitted.decode_attn_s_per_context_token == 0.0


@pytest.mark.parametrize(("samples", "expect"), [
    ([StepSample(StepBatch.of((5,)), 1.0)] * 4, r"need at least 5 samples to fit 5 terms, got 4"),
    ([StepSample(StepBatch.of((5,)), 0.0)] * 5, r"seconds > 0, got \[0.0"),
    ([StepSample(StepBatch.of(), 1.0)] * 5, r"empty batch"),
])
def test_bad_samples_are_refused(samples, expect):
    with pytest.raises(ValueError, match=expect):
        fit_profile(samples)


# --- the batched backend's terms: attention groups and their padding ------------------------------------
BATCHED_TRUTH = BatchedStepCost(label="truth", fixed_s=2e-3, linear_compute_s_per_token=1e-4,
                                lm_head_s_per_sampled_token=4e-5, decode_attn_s_per_context_token=2e-8,
                                prefill_attn_s_per_pair=1e-9, attn_group_s=7e-4,
                                decode_attn_s_per_padded_key=6e-8, prefill_attn_s_per_padded_pair=3e-9,
                                prefill_group_s=5e-4)


def test_attention_groups_follow_the_backends_buckets():
    # 5, 20 and 32 share the bucket of 32; 33 and 64 that of 64; 65 that of 128; the chunks one group;
    # a one-token chunk (ctx 99) is a decode of 100 keys to the backend
    batch = StepBatch.of((5, 20, 32, 33, 64, 65), ((40, 10), (7, 0), (1, 99)))
    assert attention_groups(batch) == (AttentionGroup(3, 1, 32), AttentionGroup(2, 1, 64),
                                       AttentionGroup(2, 1, 100), AttentionGroup(2, 40, 50))
    assert attention_groups(StepBatch.of((3, 9))) == (AttentionGroup(2, 1, 9),)  # padded to its longest
    row = dict(zip(BATCHED_TERMS, batched_term_row(batch)))
    assert row["attn_group_s"] == 4
    assert row["decode_attn_s_per_padded_key"] == 3 * 32 + 2 * 64 + 2 * 100
    assert row["prefill_attn_s_per_padded_pair"] == 2 * 40 * 50
    assert row["prefill_group_s"] == 1  # one prefill group, whatever its chunks
    # no prefill group: decodes only, or a one-token chunk (a decode to the backend)
    assert batched_term_row(StepBatch.of((3, 9), ((1, 40),)))[BATCHED_TERMS.index("prefill_group_s")] == 0


def test_batched_fit_recovers_the_group_and_padding_terms():
    samples = [StepSample(b, BATCHED_TRUTH.step_time_s(b)) for b in _batches(150)]
    fitted = fit_batched_profile(samples)
    for name in BATCHED_TERMS:
        assert getattr(fitted, name) == pytest.approx(getattr(BATCHED_TRUTH, name), rel=1e-5), name
    assert np.abs(relative_errors(fitted, samples)).max() < 1e-7
    # the linear five-term fit cannot express the groups: it misses on the same samples
    assert np.median(np.abs(relative_errors(fit_profile(samples), samples))) > 0.01


def test_identifiability_is_zero_for_terms_that_move_together_or_never_move():
    # decodes of one length per bucket: padded keys equal real context tokens in every step; no prefill
    same = [StepBatch.of((n,) * k + (m,) * k) for n, m in ((20, 40), (70, 200), (300, 30)) for k in (1, 3, 8)]
    share = term_identifiability([StepSample(b, BATCHED_TRUTH.step_time_s(b)) for b in same])
    assert share["decode_attn_s_per_context_token"] < 1e-6 and share["decode_attn_s_per_padded_key"] < 1e-6
    assert share["prefill_group_s"] == share["prefill_attn_s_per_padded_pair"] == 0.0  # never exercised
    share = term_identifiability([StepSample(b, BATCHED_TRUTH.step_time_s(b)) for b in _batches(150)])
    assert all(0.02 < v <= 1.0 for v in share.values()), share  # random steps tell every term apart
