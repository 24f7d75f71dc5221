"""The engine's public API: equal to Hugging Face through ``LLM.generate``, finish
reasons, bad requests rejected while the rest completes, a failed step leaving nothing behind, argument
errors, sizing and stats. The scheduler's exact decisions are in test_scheduler.py."""

from __future__ import annotations

import pytest
import torch
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.errors import InvalidArgumentError, InvalidRequestError
from pagedbench.refengine.tests.tiny_hf import tiny_llama

MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, attention_backend="torch", seed=2)


def rand_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, MODEL["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# --- equal to Hugging Face through the LLM API --------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    model = tiny_llama(0)
    folder = tmp_path_factory.mktemp("hf-llama")
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("chunk", [512, 3])
def test_greedy_equals_hf_generate(hf_folder, chunk):
    folder, hf = hf_folder
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (1, 4, 5, 13, 30)]
    num_new = 8
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                              min_new_tokens=num_new, do_sample=False)
            want.append(out[0, len(p):].tolist())
    llm = LLM(str(folder), dtype="float32", block_size=4, num_blocks=64, attention_backend="torch",
              max_num_batched_tokens=chunk, check_invariants=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=num_new))
    assert tokens(outs) == want
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(prompts)
    assert [o.prompt_token_ids for o in outs] == [list(p) for p in prompts]


def test_text_prompts_with_a_tokenizer(hf_folder, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    folder, _ = hf_folder
    words = [f"w{i}" for i in range(255)] + ["[UNK]"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(str(tmp_path), attention_backend="torch", block_size=4, num_blocks=64)
    by_text, by_ids = llm.generate(["w3 w17 w200", [3, 17, 200]], GREEDY)
    assert by_text.prompt_token_ids == [3, 17, 200] and by_text.prompt == "w3 w17 w200"
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text.split() == [words[t] for t in by_ids.outputs[0].token_ids]


# --- finish reasons -----------------------------------------------------------------------------------
def test_stop_token_ends_with_the_token(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=32)
    prompt = rand_prompt(6, 1)
    free = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    stop = free[3]
    cut = free.index(stop) + 1
    out = llm.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=[stop]))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free[:cut], "stop")


def test_eos_and_ignore_eos(loaded):
    base = LLM(loaded, block_size=4, num_blocks=32)
    prompt = rand_prompt(6, 1)
    free = base.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    eos = free[2]
    with_eos = load_model(dict(MODEL, eos_token_id=eos), attention_backend="torch", seed=2)
    llm = LLM(with_eos, block_size=4, num_blocks=32)
    out = llm.generate([prompt], SamplingParams(max_tokens=10))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free[:free.index(eos) + 1], "eos")
    out = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free, "length")


def test_min_tokens_defers_eos_and_stop_tokens(loaded):
    base = LLM(loaded, block_size=4, num_blocks=32)
    prompt = rand_prompt(6, 2)  # ten distinct greedy tokens
    free = base.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0].outputs[0].token_ids
    eos = free[2]
    later = next(i for i in range(5, 10) if free[i] != eos)  # a stop token first met at or after index 5
    with_eos = load_model(dict(MODEL, eos_token_id=eos), attention_backend="torch", seed=2)
    llm = LLM(with_eos, block_size=4, num_blocks=32)
    # EOS (and a stop token) before min_tokens is generated but ends nothing; greedy tokens are unchanged
    out = llm.generate([prompt], SamplingParams(max_tokens=10, min_tokens=10))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free, "length")
    stop = free[later]
    out = llm.generate([prompt], SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[stop]))[0].outputs[0]
    end = next(i for i in range(3, 10) if free[i] in (eos, stop))  # the 4th token on may end it
    assert (out.token_ids, out.finish_reason) == (free[:end + 1], "eos" if free[end] == eos else "stop")
    with pytest.raises(InvalidArgumentError, match=r"min_tokens must be an int in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_max_model_len_caps_the_output(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=32, max_model_len=20)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    outs = llm.generate([rand_prompt(16, 3), rand_prompt(20, 4)], params)
    # a sequence stops once its next token would need position >= 20
    assert [len(t) for t in tokens(outs)] == [5, 1]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]


# --- bad requests -------------------------------------------------------------------------------------
BAD_REQUESTS = {
    "empty": ([], GREEDY, "empty prompt"),
    "above-vocab": ([1, 128, 2], GREEDY, "outside the vocabulary [0, 128): [128]"),
    "negative-id": ([-1, 5], GREEDY, "outside the vocabulary [0, 128): [-1]"),
    "too-long": (list(range(65)), GREEDY, "prompt of 65 tokens exceeds the maximum length 64"),
    "never-fits": (list(range(30)), SamplingParams(max_tokens=20),
                   "can never fit the KV pool: 49 tokens (prompt + max_tokens - 1) need more than its 12"),
    "n-too-large": ([1, 2], SamplingParams(n=5), "n=5 exceeds max_num_seqs=4"),
    "text-no-tokenizer": ("hello", GREEDY, "needs a tokenizer"),
    "not-ints": ([1, 2.5], GREEDY, "token ids must be ints, got float 2.5"),
}


def test_bad_requests_rejected_rest_completes(loaded):
    good = [rand_prompt(n, n) for n in (3, 9)]
    want = tokens(LLM(loaded, block_size=4, num_blocks=12, max_num_seqs=4).generate(good, GREEDY))
    llm = LLM(loaded, block_size=4, num_blocks=12, max_num_seqs=4, check_invariants=True)
    prompts = [good[0]] + [p for p, _, _ in BAD_REQUESTS.values()] + [good[1]]
    params = [GREEDY] + [sp for _, sp, _ in BAD_REQUESTS.values()] + [GREEDY]
    outs = llm.generate(prompts, params)
    assert tokens([outs[0], outs[-1]]) == want
    assert outs[0].error is None and outs[-1].error is None
    for name, out in zip(BAD_REQUESTS, outs[1:-1]):
        assert BAD_REQUESTS[name][2] in out.error, name
        assert out.outputs == [] and out.num_cached_tokens == 0, name
    assert llm.stats.num_rejected_requests == len(BAD_REQUESTS) and llm.stats.num_requests == 2


def test_contiguous_rejects_a_reservation_larger_than_the_pool(loaded):
    llm = LLM(loaded, allocator="contiguous", block_size=4, num_blocks=15)  # max_model_len 64 = 16 blocks
    out = llm.generate([[1, 2, 3]], GREEDY)[0]
    assert "a reservation of max_model_len=64 tokens need more than its 15 blocks" in out.error


def test_strict_raises_before_running_anything(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=12)
    with pytest.raises(InvalidRequestError, match=r"2 of 3 requests rejected: prompt 1: empty prompt; "
                                                  r"prompt 2: token ids outside the vocabulary"):
        llm.generate([[1, 2], [], [999]], GREEDY, strict=True)
    assert llm.stats.num_steps == 0 and llm.stats.num_requests == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(max_tokens=0), "max_tokens must be an int >= 1, got 0"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(n=0), "n must be an int >= 1, got 0"),
    (dict(seed=-3), "seed must be None or an int"),
    (dict(stop_token_ids=[3, -1]), r"stop_token_ids must be non-negative ints, got \[-1\]"),
    (dict(ignore_eos=1), "ignore_eos must be a bool, got 1"),
])
def test_sampling_params_errors(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(allocator="buddy"), "allocator must be one of paged, contiguous; got 'buddy'"),
    (dict(block_size=0), "block_size must be an int >= 1, got 0"),
    (dict(num_blocks=8, kv_cache_memory=4096), "give exactly one of num_blocks or memory_bytes"),
    (dict(max_model_len=65), "max_model_len 65 exceeds the model's 64"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an int >= 1, got 0"),
    (dict(attention_backend="torch"), "a LoadedModel brings its own attention backend"),
    (dict(dtype="bfloat16"), "dtype bfloat16 differs from the loaded model's torch.float32"),
])
def test_llm_argument_errors(loaded, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        LLM(loaded, **kwargs)


def test_generate_argument_errors(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=12)
    with pytest.raises(InvalidArgumentError, match="flat list of ints"):
        llm.generate([1, 2, 3])
    with pytest.raises(InvalidArgumentError, match=r"one per prompt expected \(2\), got 1"):
        llm.generate([[1], [2]], [GREEDY])


def test_a_failed_step_leaves_nothing_behind(loaded, monkeypatch):
    """generate returns every request after a failed step: the ones it touched with ``error`` set and
    the tokens they had (a prefix of a clean run's), or complete when retries are allowed; Ctrl-C
    propagates and leaves no request or block behind."""
    llm = LLM(loaded, block_size=4, num_blocks=32)
    prompts = [rand_prompt(n, n) for n in (3, 9, 14)]
    want = tokens(llm.generate(prompts, GREEDY))
    forward = llm.model.forward

    def failing_at(n: int, exc: BaseException):
        calls = []

        def failing(*args):
            calls.append(1)
            if len(calls) == n:
                raise exc
            return forward(*args)
        return failing

    monkeypatch.setattr(llm.model, "forward", failing_at(3, RuntimeError("device lost")))
    outs = llm.generate(prompts, GREEDY)
    assert [o.error for o in outs] == ["a step failed: RuntimeError: device lost"] * 3
    for o, w in zip(outs, want):
        assert o.outputs[0].finish_reason == "abort" and o.outputs[0].token_ids == w[:len(o.outputs[0].token_ids)]
    assert llm.stats.num_used_blocks == 0 and not llm.scheduler.has_unfinished()
    llm.block_manager.check_invariants()
    monkeypatch.setattr(llm.model, "forward", failing_at(3, RuntimeError("device lost")))
    assert tokens(llm.generate(prompts, GREEDY, max_step_retries=1)) == want
    monkeypatch.setattr(llm.model, "forward", failing_at(3, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY)
    assert llm.stats.num_used_blocks == 0 and not llm.scheduler.has_unfinished() and not llm.core.requests
    llm.block_manager.check_invariants()
    monkeypatch.setattr(llm.model, "forward", forward)
    assert tokens(llm.generate(prompts, GREEDY)) == want


def test_a_failed_step_never_poisons_the_prefix_cache(loaded, monkeypatch):
    """A step that fails before writing its KV must leave no cached block claiming that KV: later
    prompts extending the interrupted one generate exactly what a fresh engine generates."""
    prompt = rand_prompt(5, 7)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    full = prompt + tokens(LLM(loaded, block_size=4, num_blocks=32).generate([prompt], params))[0]
    extensions = [[*full[:n], 3, 1] for n in (9, 13, 17)]  # past each block a decode step filled
    want = tokens(LLM(loaded, block_size=4, num_blocks=32).generate(extensions, GREEDY))
    forward = loaded.model.forward
    for fail_at in range(1, 13):
        llm = LLM(loaded, block_size=4, num_blocks=32)
        calls = []

        def failing(*args, fail_at=fail_at, calls=calls):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("interrupted")
            return forward(*args)

        monkeypatch.setattr(llm.model, "forward", failing)
        assert llm.generate([prompt], params)[0].error == "a step failed: RuntimeError: interrupted"
        monkeypatch.setattr(llm.model, "forward", forward)
        llm.block_manager.check_invariants()
        assert tokens(llm.generate(extensions, GREEDY)) == want, f"poisoned by a failure at step {fail_at}"


def test_cache_salt_isolates_tenants(loaded):
    """Equal salts share cached prompt blocks; a salted request never hits another salt's (or the
    unsalted) blocks, so no tenant learns another's prompts through num_cached_tokens."""
    llm = LLM(loaded, block_size=4, num_blocks=64)
    shared = rand_prompt(13, 3)
    first = llm.generate([{"prompt_token_ids": shared, "cache_salt": "tenant-a"}], GREEDY)[0]
    assert first.num_cached_tokens == 0
    outs = llm.generate([{"prompt_token_ids": shared, "cache_salt": "tenant-a"},
                         {"prompt_token_ids": shared, "cache_salt": "tenant-b"},
                         shared], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [12, 0, 0]
    assert llm.generate([shared], GREEDY)[0].num_cached_tokens == 12  # the unsalted run above cached it
    assert tokens(outs) == [first.outputs[0].token_ids] * 3  # salts change sharing, never the output


@pytest.mark.parametrize(("prompt", "message"), [
    ({"prompt_token_ids": [1, 2], "cache_salt": 7}, "cache_salt must be a non-empty string"),
    ({"prompt_token_ids": [1, 2], "prompt": "x"}, "exactly one of"),
    ({"prompt_token_ids": [1, 2], "salt": "a"}, "unknown prompt keys"),
])
def test_bad_prompt_dicts_are_rejected(loaded, prompt, message):
    out = LLM(loaded, block_size=4, num_blocks=16).generate([prompt, [1, 2]], GREEDY)
    assert message in out[0].error and out[1].error is None


# --- sizing, dtype, stats -----------------------------------------------------------------------------
def test_kv_cache_memory_sizes_the_pool(loaded):
    per_block = 2 * 2 * 4 * 2 * 8 * 4  # K and V x layers x block_size x kv heads x head_dim x fp32 bytes
    llm = LLM(loaded, block_size=4, kv_cache_memory=10 * per_block + per_block // 2)
    assert llm.pool.bytes_per_block == per_block and llm.stats.num_blocks == 10


def test_dtype_by_name():
    llm = LLM(MODEL, dtype="bfloat16", block_size=4, num_blocks=16, attention_backend="torch")
    assert llm.pool.dtype == torch.bfloat16 and llm.model.dtype == torch.bfloat16
    outs = llm.generate([rand_prompt(5, 0)], GREEDY)
    assert len(outs[0].outputs[0].token_ids) == 5


def test_stats_after_generate(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=32, check_invariants=True)
    prompt = rand_prompt(9, 0)
    llm.generate([prompt, prompt], GREEDY)
    s = llm.stats
    assert (s.num_used_blocks, s.num_free_blocks, s.num_requests) == (0, 32, 2)
    assert s.num_prompt_tokens == 18 and s.num_generated_tokens == 10
    assert s.prefix_query_tokens == 18 and s.prefix_hit_tokens == 0  # twins in one step: no hit
    # 13 tokens held at the end (9 + 5 - 1: the last one never stored): 3 full blocks each stay cached,
    # the second request's as twins of the first's (the same KV, kept so it outlives either copy)
    assert s.num_cached_blocks == 6 and s.peak_running_seqs == 2 and s.num_steps == 5
    llm.generate([prompt], GREEDY)
    s = llm.stats
    assert s.prefix_hit_tokens == 8 and s.prefix_hit_rate == pytest.approx(8 / 27)
    assert 0 < s.mean_kv_utilisation < 1


@pytest.mark.parametrize("allocator", ["paged", "contiguous"])
def test_stats_table_and_used_blocks_follow_every_step(loaded, allocator):
    """The mean table entries and used blocks equal, step by step, a pass over the running sequences'
    tables: forked children share the prompt's blocks (entries counted per table, blocks once)."""
    paged = allocator == "paged"
    llm = LLM(loaded, block_size=4, num_blocks=48, allocator=allocator, check_invariants=True)
    params = SamplingParams(n=3 if paged else 1, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    for i, n in enumerate((9, 5, 13)):
        llm.core.add(llm.core.new_request(rand_prompt(n, 10 + i), params))
    tables, used = [], []
    while llm.scheduler.has_unfinished():
        llm.step()
        tables.append(sum(-(-s.num_table_tokens // 4) for s in llm.scheduler.running))
        used.append(min(llm.block_manager.num_used_blocks, tables[-1]))
    s = llm.stats
    assert s.num_steps == len(tables)
    assert s.mean_table_blocks == pytest.approx(sum(tables) / len(tables))
    assert s.mean_used_blocks == pytest.approx(sum(used) / len(used))
    assert (s.sharing_saving > 0) == paged
