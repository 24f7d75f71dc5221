"""The sampler against expected answers: exact kept distributions, seeded draws, independent generators.

The expected probabilities are computed here from the documented procedure (``refengine.model.sampling``'s
docstring) in plain Python floats, never with the sampler's own code: temperature divides the logits,
top-k keeps the k largest, softmax, top-p keeps the smallest most-likely-first prefix reaching top_p,
one uniform draw per sampled token from the sequence's own generator.
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.model.sampling import (
    child_generator,
    greedy_tokens,
    kept_distribution,
    rewind_generator,
    sample_batch,
    sample_token,
)

# distinct logits (no ties), so "the k largest" and "most likely first" are unambiguous
LOGITS = [2.0, 1.0, 0.5, -0.25, -1.0, 3.0, 0.0]
NUM_DRAWS = 40_000
#: a chi-square p-value below this fails: a correct sampler fails one case in 10^5 runs (seeds are fixed,
#: so in practice never), while each mutant below gives p-values under 1e-100
MIN_P_VALUE = 1e-5


def expected_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The documented procedure in plain floats; token order."""
    z = [x / temperature for x in logits]
    ranked = sorted(range(len(z)), key=lambda i: -z[i])
    kept = ranked[:top_k] if 0 < top_k < len(z) else ranked
    total = sum(math.exp(z[i]) for i in kept)
    p = {i: math.exp(z[i]) / total for i in kept}
    prefix, mass = [], 0.0
    for i in kept:  # most likely first
        if mass >= top_p:
            break
        prefix.append(i)
        mass += p[i]
    return [p[i] / mass if i in prefix else 0.0 for i in range(len(z))]


# each case separates the right answer from one of the mutants it names
CASES = {
    "temperature-0.5": (0.5, 0, 1.0),  # dividing vs multiplying by 0.5 sharpens vs flattens
    "temperature-2": (2.0, 0, 1.0),
    "top-k-2": (1.0, 2, 1.0),  # k + 1 = 3 tokens would get mass
    "top-k-1": (0.7, 1, 1.0),  # greedy-like: all mass on the largest
    "top-p-0.6": (1.0, 0, 0.6),  # most likely two tokens; the least likely must get nothing
    "top-p-tiny": (1.0, 0, 1e-9),  # only the most likely token is kept
    "top-k-and-p": (1.5, 4, 0.8),  # top-k first, then top-p on the renormalised rest
    "all": (1.0, 0, 1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kept_distribution_is_exactly_the_documented_one(case):
    temperature, top_k, top_p = CASES[case]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = kept_distribution(torch.tensor([LOGITS], dtype=torch.float64), [params]).probabilities()[0]
    want = torch.tensor(expected_probs(LOGITS, temperature, top_k, top_p), dtype=torch.float64)
    # float64 softmax and sums over 7 tokens: rounding differences of a few ulps only
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test over the tokens with probability > 0."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_draws_follow_the_kept_distribution(case):
    """NUM_DRAWS rows in one batch, each with its own seeded generator: token counts must pass a chi-square
    test against the expected distribution, and a token with probability 0 is never drawn."""
    temperature, top_k, top_p = CASES[case]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = torch.tensor(expected_probs(LOGITS, temperature, top_k, top_p), dtype=torch.float64)
    logits = torch.tensor([LOGITS], dtype=torch.float32).expand(NUM_DRAWS, -1)
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(NUM_DRAWS)]
    tokens = torch.tensor(sample_batch(logits, [params] * NUM_DRAWS, gens))
    counts = torch.bincount(tokens, minlength=len(LOGITS)).to(torch.float64)
    assert counts[probs == 0].sum() == 0, f"{case}: drew tokens of probability 0: counts {counts.tolist()}"
    p_value = chi_square_p_value(counts, probs)
    assert p_value > MIN_P_VALUE, (f"{case}: counts {counts.tolist()} vs expected "
                                   f"{(probs * NUM_DRAWS).tolist()}: chi-square p = {p_value:.2e}")


def test_each_sampled_row_draws_exactly_one_uniform_and_greedy_rows_none():
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_p=0.5)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    sample_batch(torch.tensor([LOGITS] * 3), params, gens)
    for seed, gen, drew in zip((1, 2, 3), gens, (1, 0, 1)):
        ref = torch.Generator().manual_seed(seed)
        for _ in range(drew):
            torch.rand((), generator=ref, dtype=torch.float64)
        assert torch.equal(gen.get_state(), ref.get_state()), f"seed {seed}: expected {drew} draw(s)"


def test_greedy_is_the_first_argmax_and_a_row_does_not_depend_on_its_batch():
    tied = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    assert sample_token(tied[0], SamplingParams(temperature=0.0), None) == 1
    rows = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=t, top_k=k, top_p=p)
              for t, k, p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 1.0), (1.3, 0, 0.7), (1.0, 3, 0.9)]]
    together = sample_batch(rows, params, [torch.Generator().manual_seed(10 + r) for r in range(5)])
    alone = [sample_token(rows[r], params[r], torch.Generator().manual_seed(10 + r)) for r in range(5)]
    assert together == alone


# --- seeds through the engine ---------------------------------------------------------------------------
MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
NUM_TOKENS = 24
HOT = 3.0  # a high temperature: different generators give different streams with overwhelming odds


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, seed=4)


def run(loaded, prompts, params, seed: int = 0) -> list[list[int]]:
    llm = LLM(loaded, block_size=4, num_blocks=64, seed=seed)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_seeded_requests_do_not_depend_on_the_batch(loaded):
    a = SamplingParams(temperature=HOT, seed=11, max_tokens=NUM_TOKENS, ignore_eos=True)
    b = SamplingParams(temperature=HOT, seed=22, max_tokens=NUM_TOKENS, ignore_eos=True)
    together = run(loaded, [PROMPT, PROMPT], [a, b])
    assert together[0] == run(loaded, [PROMPT], a)[0]
    assert together[1] == run(loaded, [PROMPT], b)[0]
    assert together[0] != together[1], "different seeds on the same prompt gave the same tokens"


def test_unseeded_requests_each_get_their_own_generator(loaded):
    """Two unseeded requests: different streams (each its own seed), and request 0's stream is the same
    with or without a partner in its batch (no generator is shared between requests)."""
    p = SamplingParams(temperature=HOT, max_tokens=NUM_TOKENS, ignore_eos=True)
    pair = run(loaded, [PROMPT, PROMPT], p)
    assert pair[0] != pair[1], "two unseeded requests drew the same tokens"
    assert pair[0] == run(loaded, [PROMPT], p)[0], "an unseeded request's tokens depend on its batch"


@pytest.mark.parametrize("top_p,want", [(0.5, [0.5, 0.5, 0.0, 0.0]), (0.75, [1 / 3, 1 / 3, 1 / 3, 0.0])])
def test_top_p_stops_at_the_token_whose_mass_reaches_it_exactly(top_p, want):
    """Four equally likely tokens (0.25 each, exact in binary): the smallest prefix whose mass reaches
    ``top_p`` holds exactly ``top_p / 0.25`` tokens, not one more."""
    params = SamplingParams(temperature=1.0, top_p=top_p)
    got = kept_distribution(torch.zeros(1, 4, dtype=torch.float64), [params]).probabilities()[0]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)


def test_top_p_one_keeps_tokens_past_a_mass_that_rounded_to_one():
    """With ``top_p=1`` every token is kept, even one whose preceding mass has rounded to 1.0 (logits
    0, 0, -40: probabilities 0.5, 0.5 and 2e-18), also when another row of the batch cuts by top-p."""
    logits = torch.tensor([[0.0, 0.0, -40.0], [0.0, 0.0, -40.0]], dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, top_p=1.0), SamplingParams(temperature=1.0, top_p=0.5)]
    got = kept_distribution(logits, params).probabilities()
    torch.testing.assert_close(got[0], torch.softmax(logits[0], dim=0), rtol=1e-12, atol=0)
    assert got[0, 2] > 0 and got[1, 2] == 0


def pin_uniform(monkeypatch, u: float) -> None:
    """Every draw the sampler makes returns ``u`` (the generator is still passed, and ignored)."""
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor(u, dtype=torch.float64))


def test_a_draw_on_a_cumulative_boundary_takes_the_next_token(monkeypatch):
    """The drawn token is the first whose cumulative mass *exceeds* u x mass: two equally likely tokens
    and u = 0.5 (cumulative masses 0.5, 1.0) give the second."""
    pin_uniform(monkeypatch, 0.5)
    params = SamplingParams(temperature=1.0)
    assert sample_batch(torch.zeros(1, 2), [params], [torch.Generator()]) == [1]


def test_a_draw_that_rounds_up_to_the_kept_mass_stays_on_a_kept_token(monkeypatch):
    """u x mass reaching the whole kept mass (rounding; pinned here with u = 1) draws the least likely
    kept token, never one that top-k cut: with top_k=2 the second most likely of LOGITS (token 0)."""
    pin_uniform(monkeypatch, 1.0)
    params = SamplingParams(temperature=1.0, top_k=2)
    assert sample_batch(torch.tensor([LOGITS]), [params], [torch.Generator()]) == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_greedy_tokens_pick_as_torch_argmax_does(dtype):
    """Ties go to the first index and a NaN counts as the largest (its first one), whichever path (NumPy
    on the CPU for float32/64, torch otherwise) picks; the rows may be a non-contiguous view."""
    nan = math.nan
    rows = torch.tensor([[0.0, 5.0, 5.0, 1.0], [1.0, nan, 3.0, nan], [-2.0, -1.0, -1.0, -3.0],
                         [2.0, 1.0, 0.0, 2.0]], dtype=dtype)
    want = [1, 1, 1, 0]
    assert greedy_tokens(rows) == want == rows.argmax(dim=-1).tolist()
    assert greedy_tokens(rows.t().contiguous().t()) == want  # column-major strides


@pytest.mark.parametrize("keep", [0, 1, 4])
def test_rewind_generator_replays_a_childs_draws(keep):
    """A generator rewound to ``keep`` draws draws what it drew after them (how a failed step's draws
    are undone): the tokens after the rewind repeat the tokens after the first ``keep``."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0)
    gen = child_generator(11, 2)
    first = [sample_token(row, params, gen) for row in logits]
    rewind_generator(gen, keep)
    assert [sample_token(row, params, gen) for row in logits[keep:]] == first[keep:]
