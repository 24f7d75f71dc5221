"""A real checkpoint: on SmolLM2-135M-Instruct the engine's float32 beam search (``ignore_eos``) finds
transformers' best beam, tokens and cumulative log-probability.

Opt-in (marker ``model``), skipped unless the folder is prepared (``python -m pagedbench.bench.prepare_model
smollm2``; ``models/SmolLM2-135M-Instruct`` under the project root or ``$PAGEDBENCH_SMOLLM2``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedbench.refengine import LLM, BeamSearchParams  # noqa: E402

pytestmark = pytest.mark.model

PROMPTS = ("What is the capital of France?", "Write a haiku about autumn leaves.",
           "List three prime numbers greater than 10.")
MAX_TOKENS = 8
TIE = 1e-5  # HF's two best scores closer than this: either may come first
CUM_ATOL = 1e-3  # float32 logits of a 30-layer model summed over 8 tokens


@pytest.fixture(scope="module")
def folder(request) -> Path:
    path = Path(os.environ.get("PAGEDBENCH_SMOLLM2") or request.config.rootpath / "models" / "SmolLM2-135M-Instruct")
    if not path.is_dir():
        pytest.skip(f"not prepared: {path} does not exist (run `python -m pagedbench.bench.prepare_model smollm2`)")
    return path


@pytest.mark.parametrize("width", [2, 4])
def test_smollm2_best_beam_equals_transformers(folder, width):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in PROMPTS]
    llm = LLM(folder, dtype="float32", max_model_len=512)
    outs = llm.beam_search(texts, BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=True))
    for text, out in zip(texts, outs):
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
                                 num_return_sequences=width, max_new_tokens=MAX_TOKENS, eos_token_id=None,
                                 pad_token_id=tokenizer.pad_token_id or 0, length_penalty=0.0,
                                 early_stopping=False, output_scores=True, return_dict_in_generate=True)
        want, scores = ref.sequences.tolist(), ref.sequences_scores.tolist()
        best = out.sequences[0]
        accepted = [0] + ([1] if scores[0] - scores[1] < TIE else [])  # a near tie: either order
        match = [i for i in accepted if want[i] == best.tokens]
        assert match, f"{text!r}: ours {best.tokens[-MAX_TOKENS:]} vs HF {[w[-MAX_TOKENS:] for w in want[:2]]}"
        assert abs(best.cum_logprob - scores[match[0]]) < CUM_ATOL
