"""``SamplingParams(logprobs=k)``: per generated token, the sampled token's and the k most likely tokens'
log-probabilities under the model's raw distribution, checked against a float64 log-softmax of Hugging
Face's logits for the same sequence; the cumulative logprob is their sum over the sampled tokens."""

from __future__ import annotations

import pytest
import torch
from pagedbench.refengine import LLM, SamplingParams
from pagedbench.refengine.errors import InvalidArgumentError, InvalidRequestError
from pagedbench.refengine.tests.tiny_hf import tiny_llama

VOCAB = 256


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    model = tiny_llama(0)
    folder = tmp_path_factory.mktemp("hf-llama-logprobs")
    model.save_pretrained(folder)
    return folder, model.double()


def reference_logprobs(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """float64 [len(generated), vocab]: log-softmax of the logits that chose each generated token."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = hf(ids).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def check_completion(hf, prompt, completion, k: int) -> None:
    ref = reference_logprobs(hf, prompt, completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for pos, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        top = torch.topk(ref[pos], k).indices.tolist() if k else []
        assert set(entry) == {token, *top}, f"position {pos}"
        for t, lp in entry.items():
            assert lp == pytest.approx(ref[pos, t].item(), abs=2e-4), f"position {pos}, token {t}"
        total += entry[token]
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-9)
    assert completion.cumulative_logprob == pytest.approx(ref.gather(
        1, torch.tensor(completion.token_ids)[:, None]).sum().item(), abs=1e-3)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_match_a_log_softmax_of_the_logits(hf_folder, k):
    folder, hf = hf_folder
    llm = LLM(str(folder), block_size=4, num_blocks=64, dtype="float32", max_num_batched_tokens=8)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8]]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=k),  # greedy, prompt chunked
              SamplingParams(max_tokens=6, ignore_eos=True, logprobs=k, n=2, temperature=0.7, top_p=0.9, seed=1)]
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            check_completion(hf, p, c, k)
    greedy = outs[0].outputs[0]
    # greedy picks the most likely token: its logprob is the largest of its entry
    assert all(e[t] == max(e.values()) for t, e in zip(greedy.token_ids, greedy.logprobs))
    # raw logprobs: the sampled children's are the model's, not the temperature-scaled distribution's
    # (the checks above would fail by far more than their tolerance otherwise)


def test_no_logprobs_unless_asked(hf_folder):
    llm = LLM(str(hf_folder[0]), block_size=4, num_blocks=64, dtype="float32")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


def test_logprobs_survive_preemption(hf_folder):
    """A preempted sequence keeps the logprobs of the tokens it had and gets one per token after."""
    folder, hf = hf_folder
    llm = LLM(str(folder), block_size=4, num_blocks=7, dtype="float32", enable_prefix_caching=False)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2))
    assert llm.stats.num_preemptions > 0, "meant to preempt"
    for p, o in zip(prompts, outs):
        check_completion(hf, p, o.outputs[0], 2)


@pytest.mark.parametrize("bad", [-1, 1.0, True, "3"])
def test_bad_logprobs_rejected(bad):
    with pytest.raises(InvalidArgumentError,
                       match=f"logprobs must be None or an int >= 0 \\(the number of top tokens\\), got {bad!r}"):
        SamplingParams(logprobs=bad)


def test_logprobs_beyond_the_vocabulary_rejected(hf_folder):
    llm = LLM(str(hf_folder[0]), block_size=4, num_blocks=64, dtype="float32")
    ok, bad = SamplingParams(max_tokens=1, logprobs=VOCAB), SamplingParams(max_tokens=1, logprobs=VOCAB + 1)
    outs = llm.generate([[1, 2], [1, 2]], [ok, bad])
    assert outs[0].error is None and len(outs[0].outputs[0].logprobs[0]) == VOCAB
    assert outs[1].error == f"logprobs={VOCAB + 1} exceeds the vocabulary size {VOCAB}"
    with pytest.raises(InvalidRequestError, match="exceeds the vocabulary size"):
        llm.generate([[1, 2]], bad, strict=True)
