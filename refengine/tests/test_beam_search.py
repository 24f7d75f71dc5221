"""Beam search on the block manager against ``transformers`` and against a from-scratch search.

One small random Llama (float32, weights spread as in ``test_model_hf``) is saved with an EOS token that
the search meets: the token greedy decoding emits second. With ``ignore_eos`` every beam runs to
``max_tokens``, and the best beam's tokens and cumulative log-probability must equal
``generate(num_beams=W, do_sample=False, eos_token_id=None)``'s (HF's own full forward, its own beam
bookkeeping). With EOS allowed, every sequence must equal a search written here over HF's logits with
vLLM's rule (each beam's top 2W candidates; EOS candidates finish and are never extended; the best W
others go on; no early stop; final ranking by cum_logprob / len ** length_penalty, prompt included).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedbench.refengine import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from pagedbench.refengine.engine.beam_search import select_candidates  # noqa: E402
from pagedbench.refengine.errors import InvalidArgumentError, InvalidRequestError  # noqa: E402
from pagedbench.refengine.tests.tiny_hf import tiny_llama  # noqa: E402

#: two candidates whose scores differ by less than this may come in either order (float32 logits of two
#: implementations differ by ~2e-6; see test_model_hf's bound)
TIE = 1e-5
#: cumulative log-probabilities over a few tokens: float32 logits summed (HF's beam scores are float32)
CUM_ATOL = 1e-4
PROMPTS = ([3, 17, 42], [7, 1, 99, 250, 18, 5, 61], [200])  # lengths 3, 7, 1 around block_size 4
MAX_TOKENS = 6


def _build(seed: int = 0):
    return tiny_llama(seed)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    model = _build()
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0]])
        greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    eos = int(greedy[0, -1])
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    folder = tmp_path_factory.mktemp("beam-llama")
    model.save_pretrained(folder)
    return model, folder, eos


def _llm(folder, **kw) -> LLM:
    kw = {"block_size": 4, "num_blocks": 64, "check_invariants": True, **kw}
    return LLM(str(folder), dtype="float32", attention_backend="torch-batched", **kw)


def _hf_beams(model, prompt: list[int], width: int) -> tuple[list[list[int]], list[float]]:
    """HF's beams for one prompt, best first: (tokens with prompt, summed log-probabilities)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
                             num_return_sequences=width, max_new_tokens=MAX_TOKENS, eos_token_id=None,
                             pad_token_id=0, length_penalty=0.0, early_stopping=False,
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences.tolist(), out.sequences_scores.tolist()  # length_penalty 0: the sums themselves


@pytest.mark.parametrize("width", [2, 4])
def test_best_beam_equals_transformers(hf_folder, width):
    model, folder, _ = hf_folder
    llm = _llm(folder)
    outs = llm.beam_search(list(PROMPTS), BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS,
                                                           ignore_eos=True))
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        want_tokens, want_scores = _hf_beams(model, prompt, width)
        best = out.sequences[0]
        assert len(out.sequences) == width
        assert [s.finish_reason for s in out.sequences] == ["length"] * width
        assert best.tokens[:len(prompt)] == prompt and len(best.tokens) == len(prompt) + MAX_TOKENS
        assert math.isclose(best.cum_logprob, sum(best.logprobs), abs_tol=1e-9)
        # HF's best, or its second when the two are within TIE of each other (either order accepted)
        accepted = [0] + ([1] if width > 1 and want_scores[0] - want_scores[1] < TIE else [])
        match = [i for i in accepted if want_tokens[i] == best.tokens]
        assert match, f"prompt {prompt}: ours {best.tokens} vs HF {want_tokens[:2]} (scores {want_scores[:2]})"
        assert abs(best.cum_logprob - want_scores[match[0]]) < CUM_ATOL
        scores = [s.cum_logprob for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
    m = llm.block_manager.metrics()
    if width > 1:
        assert m.forks > 0 and m.copy_on_write_copies > 0  # beams shared blocks and split them on write
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def _reference_search(model, prompt: list[int], width: int, eos: int, length_penalty: float = 1.0):
    """vLLM's rule over HF's full-forward logits (float64 log-softmax): [(tokens, cum_logprob)], best first."""
    beams = [(list(prompt), 0.0)]
    done = []
    for _ in range(MAX_TOKENS):
        cands = []
        for toks, cum in beams:
            with torch.no_grad():
                row = model(torch.tensor([toks])).logits[0, -1].double()
            lp, tok = torch.log_softmax(row, -1).topk(2 * width)
            for lp_i, t in zip(lp.tolist(), tok.tolist()):
                (done if t == eos else cands).append(([*toks, t], cum + lp_i))
        cands.sort(key=lambda c: -c[1])
        beams = cands[:width]
    done += beams

    def score(h):
        n = len(h[0]) - (h[0][-1] == eos)
        return h[1] / n ** length_penalty
    return sorted(done, key=lambda h: -score(h))[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_eos_rule_equals_reference_search(hf_folder, length_penalty):
    model, folder, eos = hf_folder
    llm = _llm(folder)
    width = 3
    outs = llm.beam_search(list(PROMPTS), BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS,
                                                           length_penalty=length_penalty))
    reasons = []
    for prompt, out in zip(PROMPTS, outs):
        want = _reference_search(model, prompt, width, eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want], f"prompt {prompt}"
        for s, w in zip(out.sequences, want):
            assert abs(s.cum_logprob - w[1]) < CUM_ATOL
            assert s.finish_reason == ("eos" if s.tokens[-1] == eos else "length")
            assert eos not in s.tokens[len(prompt):-1]  # a beam that met EOS was never extended
        reasons += [s.finish_reason for s in out.sequences]
    assert "eos" in reasons and "length" in reasons  # the rule was exercised both ways
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_preemption_keeps_results_and_frees_everything(hf_folder):
    """A pool too small for every search at once: requests are preempted (beams together) and
    recomputed, and the beams equal the unconstrained run's."""
    _, folder, _ = hf_folder
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)
    want = _llm(folder).beam_search(list(PROMPTS), params)
    llm = _llm(folder, num_blocks=12)
    got = llm.beam_search(list(PROMPTS), params)
    assert llm.stats.num_preemptions > 0
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in want]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_select_candidates_rule():
    """vLLM's rule on a hand-made step: EOS candidates finish, the best W others go on, best first."""
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.05, 0.05, 0.6, 0.3]], dtype=torch.float64))
    kept, ended = select_candidates([0.0, -1.0], lp, 2, frozenset({0}))
    # cum: beam 0 -> EOS -0.69 (finishes), token 1 -1.20, token 2 -2.30; beam 1 -> token 2 -1.51
    assert [(c.beam, c.token) for c in kept] == [(0, 1), (1, 2)]
    assert [round(c.cum_logprob, 2) for c in kept] == [-1.20, -1.51]
    assert [(c.beam, c.token) for c in ended] == [(0, 0), (1, 0)]  # each beam's top 2W holds EOS
    kept, ended = select_candidates([0.0, -1.0], lp, 2, frozenset())
    assert [(c.beam, c.token) for c in kept] == [(0, 0), (0, 1)] and ended == []


def test_bad_input_names_the_option_and_leaves_the_engine_usable(hf_folder):
    _, folder, _ = hf_folder
    llm = _llm(folder, num_blocks=8, max_num_seqs=4)
    with pytest.raises(InvalidArgumentError, match="beam_width must be an int >= 1, got 0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidArgumentError, match=r"beam_search takes BeamSearchParams.*SamplingParams"):
        llm.beam_search([PROMPTS[0]], SamplingParams(n=2))
    with pytest.raises(InvalidArgumentError, match="generate takes SamplingParams"):
        llm.generate([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(InvalidRequestError, match=r"beam_width=5 exceeds max_num_seqs=4"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=5, max_tokens=2))
    # 3 + 6 - 1 = 8 tokens: 2 blocks a beam unshared; 8 blocks hold 4 beams, not 5
    big = _llm(folder, num_blocks=8)
    with pytest.raises(InvalidRequestError, match=r"prompt 1: beam_width=5 can never fit the KV pool.*"
                                                  r"beam_width <= 4 fits"):
        big.beam_search([PROMPTS[2], PROMPTS[0]], BeamSearchParams(beam_width=5, max_tokens=MAX_TOKENS))
    with pytest.raises(InvalidArgumentError, match=r"beam search needs the paged allocator.*'contiguous'"):
        _llm(folder, allocator="contiguous", max_model_len=16).beam_search([PROMPTS[0]], BeamSearchParams(2, 2))
    for engine in (llm, big):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not engine.scheduler.has_unfinished()
        out = engine.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3))
        assert len(out[0].sequences) == 2


def test_a_failed_step_frees_every_beam_and_the_engine_goes_on(hf_folder, monkeypatch):
    """The model fails mid-search (beams forked, blocks shared): the error propagates, every request's
    beams are dropped with their blocks, and the next search runs as on a fresh engine."""
    _, folder, _ = hf_folder
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = _llm(folder).beam_search(list(PROMPTS), params)
    llm = _llm(folder)
    real = llm.executor.forward_logits
    calls = []

    def failing(out):
        calls.append(1)
        if len(calls) == 4:
            assert llm.block_manager.metrics().forks > 0  # the failure meets shared blocks
            raise RuntimeError("device lost")
        return real(out)

    monkeypatch.setattr(llm.executor, "forward_logits", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.beam_search(list(PROMPTS), params)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert not llm.scheduler.has_unfinished()
    llm.block_manager.check_invariants()
    got = llm.beam_search(list(PROMPTS), params)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in want]
