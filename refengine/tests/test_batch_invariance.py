"""``LLM(batch_invariant=True)``: a request's logits, bit for bit, alone and beside random neighbours.

Alone: the request is the only one and its prompt runs in one chunk. Beside neighbours: random other
prompts share every step and a small token budget chunks every prefill at places that depend on the
neighbours. The logits of every token the request samples (its prompt's last position, then each
decode) are compared with ``torch.equal``; with the mode off they differ in the last bits.
"""

from __future__ import annotations

import pytest
import torch
from pagedbench.refengine import LLM, SamplingParams, load_model

MODEL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def logits_by_request(llm: LLM, prompts, params=PARAMS) -> list[list[torch.Tensor]]:
    """The logits rows each prompt's sequence sampled from, in order, read from the model directly."""
    rows: dict[int, list[torch.Tensor]] = {}
    llm.executor.logits_hook = lambda seq_ids, logits: [
        rows.setdefault(s, []).append(logits[i].clone()) for i, s in enumerate(seq_ids)]
    seq_ids = []
    for p in prompts:
        req = llm.core.new_request(p, params)
        llm.core.add(req)
        seq_ids.append(req.children[0].seq_id)
    while llm.scheduler.has_unfinished():
        llm.step()
    llm.executor.logits_hook = None
    return [rows[s] for s in seq_ids]


def alone_vs_neighbours(loaded, prompts, *, invariant: bool, seed: int, block_size: int = 4,
                        budget: int = 7, num_neighbours: int = 6, vocab: int = MODEL["vocab_size"]) -> list[bool]:
    """For each prompt: are its logits alone equal (bit for bit) to those beside random neighbours?"""
    alone = [logits_by_request(LLM(loaded, block_size=block_size, num_blocks=512, enable_prefix_caching=False,
                                   max_num_batched_tokens=512, batch_invariant=invariant), [p])[0]
             for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    batch = [torch.randint(0, vocab, (int(n),), generator=gen).tolist()
             for n in torch.randint(1, 40, (num_neighbours,), generator=gen)]
    spots = torch.randperm(len(batch) + len(prompts), generator=gen).tolist()
    mixed = [None] * len(spots)
    for i, p in enumerate(prompts):
        mixed[spots[i]] = p
    rest = iter(batch)
    mixed = [m if m is not None else next(rest) for m in mixed]
    llm = LLM(loaded, block_size=block_size, num_blocks=512, enable_prefix_caching=False,
              max_num_batched_tokens=budget, batch_invariant=invariant)
    got = logits_by_request(llm, mixed)
    out = []
    for i, want in enumerate(alone):
        rows = got[spots[i]]
        out.append(len(rows) == len(want) and all(torch.equal(a, b) for a, b in zip(rows, want)))
    return out


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, attention_backend="torch-batched", seed=3)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, MODEL["vocab_size"], (n,), generator=gen).tolist() for n in (1, 5, 33, 40)]


@pytest.mark.parametrize("seed", [0, 1])
def test_invariant_alone_equals_beside_neighbours(loaded, prompts, seed):
    assert alone_vs_neighbours(loaded, prompts, invariant=True, seed=seed) == [True] * len(prompts)


def test_invariant_with_the_reference_backend(prompts):
    """The per-sequence torch backend writes K/V its own way and attends in the same fixed order."""
    ref = load_model(MODEL, attention_backend="torch", seed=3)
    assert alone_vs_neighbours(ref, prompts[2:], invariant=True, seed=2) == [True, True]


def test_default_mode_is_not_invariant(loaded, prompts):
    """What the README says of the default mode: some request's logits move with its neighbours."""
    assert not all(alone_vs_neighbours(loaded, prompts, invariant=False, seed=0))


def test_invariant_logits_close_to_default(loaded, prompts):
    """The fixed order changes rounding only: the two modes' logits agree to float32 precision."""
    llm = LLM(loaded, block_size=4, num_blocks=256, enable_prefix_caching=False)
    fixed = LLM(loaded, block_size=4, num_blocks=256, enable_prefix_caching=False, batch_invariant=True)
    for a, b in zip(logits_by_request(llm, prompts), logits_by_request(fixed, prompts)):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), rtol=1e-5, atol=1e-5)


@pytest.mark.model
def test_invariant_on_smollm2(request):
    """The real checkpoint (``make model``): two prompts alone and beside neighbours, budget 16."""
    import os
    from pathlib import Path

    folder = Path(os.environ.get("PAGEDBENCH_SMOLLM2")
                  or request.config.rootpath / "models" / "SmolLM2-135M-Instruct")
    if not folder.is_dir():
        pytest.skip(f"not prepared: {folder} does not exist (run `make model`)")
    smol = load_model(folder, dtype="float32", attention_backend="torch-batched")
    gen = torch.Generator().manual_seed(5)
    vocab = smol.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (40, 23)]
    kw = dict(block_size=16, budget=16, num_neighbours=3, vocab=vocab)
    assert alone_vs_neighbours(smol, prompts, invariant=True, seed=0, **kw) == [True, True]
    assert not all(alone_vs_neighbours(smol, prompts, invariant=False, seed=0, **kw))


def test_invariant_with_a_cached_prefix(loaded, prompts):
    """A prompt whose first blocks come from the prefix cache (written by another request's prefill, in
    other chunks) gets the logits it gets alone."""
    prompt = prompts[3]
    alone = logits_by_request(LLM(loaded, block_size=4, num_blocks=256, enable_prefix_caching=False,
                                  batch_invariant=True), [prompt])[0]
    llm = LLM(loaded, block_size=4, num_blocks=256, max_num_batched_tokens=5, batch_invariant=True)
    logits_by_request(llm, [[*prompt[:22], 1, 2, 3]])  # publishes the first 5 blocks of `prompt`
    got = logits_by_request(llm, [prompt])[0]
    assert llm.stats.prefix_hit_tokens == 20
    assert len(got) == len(alone) and all(torch.equal(a, b) for a, b in zip(got, alone))
