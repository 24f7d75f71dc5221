"""A real checkpoint: on SmolLM2-135M-Instruct the engine's float32 greedy tokens equal transformers'.

Opt-in (marker ``model``) and skipped unless the folder has been prepared with
``python -m pagedbench.bench.prepare_model smollm2`` (``models/SmolLM2-135M-Instruct`` under the project root, or the
folder named by ``$PAGEDBENCH_SMOLLM2``). Eight chat prompts of different lengths go through the chat
template as strings; the engine serves them in one batch (``ignore_eos``, 16 new tokens each) and each must
equal a greedy loop over ``transformers``' own model, one prompt at a time, that also runs past EOS (argmax
over the whole vocabulary at every step, as the engine does with ``ignore_eos``).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedbench.refengine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.model

FOLDER_NAME = "SmolLM2-135M-Instruct"
NUM_NEW_TOKENS = 16
PROMPTS = (
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish and German.",
    "You have a 3-litre jug and a 5-litre jug. How do you measure exactly 4 litres of water? Think step by "
    "step and explain each pour.",
    "Summarise the plot of Romeo and Juliet for a ten-year-old, in two or three short sentences, without "
    "spoiling the ending too bluntly, and suggest one question the child could discuss afterwards.",
)


@pytest.fixture(scope="module")
def folder(request) -> Path:
    path = Path(os.environ.get("PAGEDBENCH_SMOLLM2") or request.config.rootpath / "models" / FOLDER_NAME)
    if not path.is_dir():
        pytest.skip(f"not prepared: {path} does not exist (run `python -m pagedbench.bench.prepare_model smollm2`)")
    return path


@pytest.fixture(scope="module")
def hf(folder):
    """(tokenizer, float32 model) from transformers."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def chat_texts(hf) -> list[str]:
    tokenizer, _ = hf
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def engine_outputs(folder, chat_texts):
    llm = LLM(folder, dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    return llm.generate(chat_texts, params, strict=True)


def hf_greedy(model, prompt_ids: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens past EOS with transformers' model and KV cache, and at each step the margin between
    the two largest logits. (``generate`` stops at EOS; :func:`test_the_oracle_agrees_with_generate`
    checks this loop against it.)"""
    cache = transformers.DynamicCache()
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, margins = [], []
    step_ids = prompt_ids
    with torch.no_grad():
        for _ in range(num_new):
            logits = model(torch.tensor([step_ids]), use_cache=True, **{cache_arg: cache}).logits[0, -1]
            top2 = torch.topk(logits.float(), 2).values
            tokens.append(int(logits.argmax()))
            margins.append(float(top2[0] - top2[1]))
            step_ids = tokens[-1:]
    return tokens, margins


@pytest.fixture(scope="module")
def hf_outputs(hf, engine_outputs) -> list[tuple[list[int], list[float]]]:
    _, model = hf
    return [hf_greedy(model, out.prompt_token_ids, NUM_NEW_TOKENS) for out in engine_outputs]


def test_engine_tokenizes_the_chat_text_as_transformers(hf, chat_texts, engine_outputs):
    tokenizer, _ = hf
    for i, (text, out) in enumerate(zip(chat_texts, engine_outputs)):
        assert out.prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids, f"prompt {i}"
        assert out.prompt_token_ids == tokenizer(text).input_ids, f"prompt {i} (with special tokens)"


def test_the_oracle_agrees_with_generate(hf, engine_outputs, hf_outputs):
    """transformers' ``generate`` (stopping at EOS) gives the oracle's tokens up to its first EOS."""
    _, model = hf
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    for i, (out, (tokens, _)) in enumerate(zip(engine_outputs, hf_outputs)):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=NUM_NEW_TOKENS)[0, ids.shape[1]:].tolist()
        end = next((j + 1 for j, t in enumerate(tokens) if t in eos_ids), len(tokens))
        assert generated[:end] == tokens[:end], f"prompt {i}"


def test_fp32_greedy_tokens_equal_transformers(hf, engine_outputs, hf_outputs):
    tokenizer, _ = hf
    failures = []
    for i, (out, (theirs, margins)) in enumerate(zip(engine_outputs, hf_outputs)):
        ours = out.outputs[0].token_ids
        assert len(ours) == NUM_NEW_TOKENS, f"prompt {i}: {len(ours)} tokens with ignore_eos"
        if ours != theirs:
            at = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            failures.append(
                f"prompt {i} ({len(out.prompt_token_ids)} tokens): first difference at new token {at} "
                f"(HF top-2 logit margin there {margins[at]:.3g}); "
                f"ours {tokenizer.decode(ours)!r} vs HF {tokenizer.decode(theirs)!r}"
            )
    assert not failures, "\n".join(failures)


def test_the_answers_are_not_degenerate(hf, engine_outputs):
    """A guard on the checkpoint itself: the model must answer sensibly, or equality proves little."""
    tokenizer, _ = hf
    answer = tokenizer.decode(engine_outputs[1].outputs[0].token_ids, skip_special_tokens=True)
    assert "Paris" in answer, answer
