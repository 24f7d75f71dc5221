"""Presence, frequency and repetition penalties (vLLM's semantics) against a per-sequence reference.

The reference here is plain torch, one sequence and one token at a time, written from the documented
rule (``refengine.model.penalties``): repetition on tokens seen in the prompt or the output (a logit > 0
divided, <= 0 multiplied), then frequency times the output count, then presence once per output token.
Every test draws fresh random logits and histories (with repeats, so counts exceed 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from pagedbench.refengine import LLM, ModelConfig, SamplingParams
from pagedbench.refengine.cli import named_configs_path
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.model.penalties import apply_penalties
from pagedbench.refengine.model.sampling import sample_batch

VOCAB = 50


@dataclass
class History:
    token_ids: list[int]
    num_prompt_tokens: int


def reference_row(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    x = row.clone().float()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t)
        x[t] -= p.presence_penalty
    return x


def random_case(seed: int, num_rows: int, penalized_every: int = 1):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB, generator=gen) * 3
    params, histories = [], []
    for r in range(num_rows):
        # tokens from a narrow range repeat, and overlap between prompt and output
        lo = int(torch.randint(0, VOCAB - 12, (), generator=gen))
        prompt = torch.randint(lo, lo + 12, (int(torch.randint(1, 20, (), generator=gen)),), generator=gen).tolist()
        output = torch.randint(lo, lo + 12, (int(torch.randint(0, 15, (), generator=gen)),), generator=gen).tolist()
        histories.append(History(prompt + output, len(prompt)))
        if r % penalized_every:
            params.append(SamplingParams())
            continue
        u = torch.rand(3, generator=gen).tolist()
        params.append(SamplingParams(presence_penalty=4 * u[0] - 2, frequency_penalty=4 * u[1] - 2,
                                     repetition_penalty=0.3 + 2.5 * u[2]))
    return logits, params, histories


def reference(logits, params, histories) -> torch.Tensor:
    return torch.stack([reference_row(logits[r], h.token_ids[:h.num_prompt_tokens],
                                      h.token_ids[h.num_prompt_tokens:], params[r])
                        for r, h in enumerate(histories)])


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_penalties_match_the_per_sequence_reference(seed):
    logits, params, histories = random_case(seed, 9)
    raw = logits.clone()
    got = apply_penalties(logits, params, histories)
    torch.testing.assert_close(got, reference(raw, params, histories), rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, raw), "the caller's logits were modified"
    assert not torch.equal(got, raw)


@pytest.mark.parametrize("seed", [5, 6])
def test_mixed_batch_each_row_as_alone(seed):
    """Unpenalised rows pass bit for bit; a penalised row is bit-identical to itself penalised alone."""
    logits, params, histories = random_case(seed, 8, penalized_every=2)
    got = apply_penalties(logits, params, histories)
    for r in range(len(params)):
        alone = apply_penalties(logits[r:r + 1], params[r:r + 1], histories[r:r + 1])[0]
        assert torch.equal(got[r], alone), f"row {r}"
        if not params[r].penalized:
            assert torch.equal(got[r], logits[r]), f"row {r}"
    torch.testing.assert_close(got, reference(logits, params, histories), rtol=1e-6, atol=1e-6)


def _generators(draw: int, num_rows: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 * draw + r) for r in range(num_rows)]


def test_sampler_applies_penalties_before_temperature_and_greedy():
    """Seeded draws and argmaxes from penalised params equal those from reference-penalised logits with
    no penalties: penalties come first, for sampled and greedy rows alike."""
    logits, params, histories = random_case(7, 12)
    params = [SamplingParams(temperature=(0.0 if r % 3 == 0 else 0.7), top_k=(5 if r % 2 else 0),
                             presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                             repetition_penalty=p.repetition_penalty) for r, p in enumerate(params)]
    plain = [SamplingParams(temperature=p.temperature, top_k=p.top_k) for p in params]
    want_logits = reference(logits, params, histories)
    for draw in range(20):
        got = sample_batch(logits, params, _generators(draw, len(params)), histories)
        want = sample_batch(want_logits, plain, _generators(draw, len(params)))
        assert got == want, f"draw {draw}"
    with pytest.raises(InvalidArgumentError, match="penalties need one token history per row; got None for 12"):
        sample_batch(logits, params, [torch.Generator()] * 12)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_yaml(named_configs_path(), name="tiny")


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # few distinct ids: the prompt repeats itself, as a repetition penalty expects
    return [torch.randint(1, 12, (n,), generator=gen).tolist() for n in (7, 19, 3)]


def _checked_run(llm: LLM, prompts, params: list[SamplingParams]):
    """Generate, checking at every sampled step that each greedy token is the argmax of the reference
    penalties over that step's raw logits and the sequence's prompt and tokens so far."""
    rows: dict[int, list[torch.Tensor]] = {}
    llm.executor.logits_hook = lambda ids, logits: [rows.setdefault(i, []).append(logits[j].clone())
                                                    for j, i in enumerate(ids)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seq_ids = sorted(rows)  # one sequence per request, in submission order
    for o, p, sp, sid in zip(outs, prompts, params, seq_ids):
        tokens = o.outputs[0].token_ids
        assert len(rows[sid]) == len(tokens)
        for k, row in enumerate(rows[sid]):
            want = int(reference_row(row, p, tokens[:k], sp).argmax())
            assert tokens[k] == want, f"prompt {p}: token {k} is {tokens[k]}, the reference's {want}"
    return [o.outputs[0].token_ids for o in outs]


def test_llm_greedy_repetition_penalty_changes_tokens_as_the_reference(tiny):
    prompts = _prompts(tiny.vocab_size, 11)
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    strong = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=3.0)
    both = SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5,
                          repetition_penalty=1.3)
    base = _checked_run(LLM(tiny, seed=0, block_size=8), prompts, [plain] * 3)
    mixed = _checked_run(LLM(tiny, seed=0, block_size=8), prompts, [strong, plain, both])
    assert mixed[1] == base[1], "an unpenalised request changed beside penalised ones"
    assert mixed[0] != base[0] and mixed[2] != base[2], "the penalties changed nothing"


def test_penalties_see_the_same_tokens_after_preemption(tiny):
    """A recomputed sequence's generated tokens still count as generated (not as prompt): negative
    penalties, which reward repeating them, make the difference show."""
    prompts = _prompts(tiny.vocab_size, 12)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=-0.7, presence_penalty=-1.0)] * 3
    llm = LLM(tiny, seed=0, block_size=4, num_blocks=12, enable_prefix_caching=False)
    preempted = _checked_run(llm, prompts, params)
    assert llm.stats.num_preemptions > 0, "meant to preempt"
    assert preempted == _checked_run(LLM(tiny, seed=0, block_size=4), prompts, params)


def test_parallel_children_are_penalised_by_their_own_tokens(tiny):
    """Child i of a seeded n=3 request equals the n=1 request seeded seed + i (its own outputs count)."""
    prompt = {"prompt_token_ids": _prompts(tiny.vocab_size, 13)[1]}
    kw = dict(max_tokens=20, ignore_eos=True, temperature=1.0, frequency_penalty=2.0, presence_penalty=1.0)
    together = LLM(tiny, seed=0).generate([prompt], SamplingParams(n=3, seed=40, **kw))[0].outputs
    alone = [LLM(tiny, seed=0).generate([prompt], SamplingParams(seed=40 + i, **kw))[0].outputs[0].token_ids
             for i in range(3)]
    assert [c.token_ids for c in together] == alone


def test_logprobs_stay_the_raw_ones(tiny):
    llm = LLM(tiny, seed=0)
    raw: list[torch.Tensor] = []
    llm.executor.logits_hook = lambda ids, logits: raw.append(logits[0].clone())
    out = llm.generate([_prompts(tiny.vocab_size, 14)[0]],
                       SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, repetition_penalty=2.5,
                                      frequency_penalty=2.0))[0].outputs[0]
    for k, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        lp = torch.log_softmax(raw[k].double(), dim=-1)
        assert entry[token] == pytest.approx(lp[token].item(), abs=1e-5), f"token {k}"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2], got 2.5"),
    ({"presence_penalty": -2.01}, "presence_penalty must be a number in [-2, 2], got -2.01"),
    ({"presence_penalty": float("nan")}, "presence_penalty must be a number in [-2, 2], got nan"),
    ({"frequency_penalty": 3}, "frequency_penalty must be a number in [-2, 2], got 3"),
    ({"frequency_penalty": "1"}, "frequency_penalty must be a number in [-2, 2], got '1'"),
    ({"frequency_penalty": True}, "frequency_penalty must be a number in [-2, 2], got True"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0, got 0.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be a finite number > 0, got -1.0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0, got inf"),
])
def test_bad_penalties_rejected(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_boundary_penalties_accepted_and_defaults_not_penalized():
    assert not SamplingParams().penalized
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1e-3).penalized
    assert SamplingParams(repetition_penalty=1.01).penalized
