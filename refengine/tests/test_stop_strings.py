"""``SamplingParams(stop=...)``: a completion ends at the first token whose text completes a stop string,
its text cut before it (or kept through it), its blocks freed in that step, other completions untouched.

The reference is naive: decode every prefix of the unconstrained completion and take the first that
holds a stop string, which the engine's incremental search must reproduce.
"""

from __future__ import annotations

import json

import pytest
from pagedbench.refengine import LLM, SamplingParams
from pagedbench.refengine.cli import named_configs_path
from pagedbench.refengine.engine.stop_strings import find_stop
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.model.config import ModelConfig
from pagedbench.refengine.model.loader import load_model
from pagedbench.refengine.tests.test_cli import HF_CONFIG

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "to", "sea", "red", "sun", "up", "hi"]


@pytest.fixture(scope="module")
def words_folder(tmp_path_factory):
    """A Hugging Face folder whose word-level tokenizer names all 16 token ids."""
    tokenizers = pytest.importorskip("tokenizers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path_factory.mktemp("words")
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    model = load_model(ModelConfig.from_hf_dict(HF_CONFIG), attention_backend="torch", seed=5).model
    safetensors_torch.save_file(model.state_dict(), str(path / "model.safetensors"))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="the"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    template = "{{ bos_token }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "hi"}))
    return path


@pytest.fixture(scope="module")
def llm(words_folder):
    return LLM(str(words_folder), seed=0, num_blocks=32, block_size=4)


PROMPTS = ["the cat sat", "a dog ran far", "red sun up"]


def free_run(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(max_tokens=14, ignore_eos=True, **kw), use_tqdm=False)[0]


def naive_stop(tokenizer, ids, stops, include=False):
    """(tokens kept, text) by decoding every prefix: the first that holds a stop string ends it."""
    for m in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:m])
        found = find_stop(text, tuple(stops), 0)
        if found is not None:
            at, stop = found
            return ids[:m], text[:at + len(stop)] if include else text[:at]
    return ids, tokenizer.decode(ids)


def stops_to_try(text: str) -> list[str]:
    """Stop strings over the free run's text: a whole later word, a span across a space, a word's tail."""
    words = text.split(" ")
    assert len(words) >= 6, text
    return [words[4], f"{words[2][-1]} {words[3][:2]}", words[5][1:] or words[5]]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_where_the_naive_decode_first_holds_one(llm, include):
    tried = 0
    for prompt in PROMPTS:
        free = free_run(llm, prompt).outputs[0]
        for stop in stops_to_try(free.text):
            want_ids, want_text = naive_stop(llm.tokenizer, free.token_ids, [stop], include)
            got = free_run(llm, prompt, stop=[stop], include_stop_str_in_output=include).outputs[0]
            assert (got.token_ids, got.text, got.finish_reason) == (want_ids, want_text, "stop"), (prompt, stop)
            assert got.text.endswith(stop) == include or stop in got.text[:-len(stop)]
            tried += 1
    assert tried == 3 * len(PROMPTS)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_the_earliest_of_several_stops_wins_and_a_missing_one_changes_nothing(llm):
    free = free_run(llm, PROMPTS[0]).outputs[0]
    words = free.text.split(" ")
    got = free_run(llm, PROMPTS[0], stop=["zzz", words[5], words[3]]).outputs[0]
    want_ids, want_text = naive_stop(llm.tokenizer, free.token_ids, [words[5], words[3]])
    assert (got.token_ids, got.text) == (want_ids, want_text)
    unmatched = free_run(llm, PROMPTS[0], stop="zzz").outputs[0]
    assert (unmatched.token_ids, unmatched.text, unmatched.finish_reason) == (free.token_ids, free.text, "length")


def test_a_stopped_sequence_frees_its_blocks_in_that_step_and_the_others_run_on(llm):
    frees = [free_run(llm, p).outputs[0] for p in PROMPTS]
    stop = frees[1].text.split(" ")[3]
    want_ids, _ = naive_stop(llm.tokenizer, frees[1].token_ids, [stop])
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    reqs = [llm.add_request(p, SamplingParams(max_tokens=14, ignore_eos=True, stop=[stop]) if i == 1 else params)
            for i, p in enumerate(PROMPTS)]
    stopped = reqs[1].children[0]
    while stopped.finish_reason is None:
        finished = llm.step()
    assert stopped in finished and stopped.finish_reason == "stop"
    assert stopped.output_token_ids == want_ids
    assert not llm.block_manager.has_sequence(stopped.seq_id)  # freed before the next step plans
    while llm.scheduler.has_unfinished():
        llm.step()
    outs = [r.output(llm.tokenizer).outputs[0] for r in reqs]
    assert [outs[0].token_ids, outs[2].token_ids] == [frees[0].token_ids, frees[2].token_ids]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_each_sampled_child_stops_on_its_own(llm):
    free = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=14, ignore_eos=True, n=3, temperature=1.0, seed=7),
                        use_tqdm=False)[0].outputs
    stop = free[0].text.split(" ")[2]
    got = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=14, ignore_eos=True, n=3, temperature=1.0, seed=7,
                                                    stop=[stop]), use_tqdm=False)[0].outputs
    assert got[0].finish_reason == "stop"
    for f, g in zip(free, got):
        want_ids, want_text = naive_stop(llm.tokenizer, f.token_ids, [stop])
        assert (g.token_ids, g.text) == (want_ids, want_text)
        assert g.finish_reason == ("stop" if want_ids != f.token_ids or stop in f.text else "length")


def test_stop_strings_wait_for_min_tokens(llm):
    free = free_run(llm, PROMPTS[0]).outputs[0]
    words = free.text.split(" ")
    first = words[1]
    got = free_run(llm, PROMPTS[0], stop=[first], min_tokens=3).outputs[0]
    # the check starts at the third token: only an occurrence whose text ends at or after it counts
    start = len(llm.tokenizer.decode(free.token_ids[:2]))
    ids = free.token_ids
    want = next((m for m in range(3, len(ids) + 1)
                 if find_stop(llm.tokenizer.decode(ids[:m]), (first,), start) is not None), len(ids))
    assert len(got.token_ids) == want


def test_stop_strings_need_a_tokenizer():
    bare = LLM(ModelConfig.from_yaml(named_configs_path(), name="tiny"), seed=0)
    req = bare.add_request([1, 2, 3], SamplingParams(stop=["x"]))
    assert req.error == "stop strings need a tokenizer; the model has none (use stop_token_ids)"
    assert not bare.scheduler.has_unfinished()


@pytest.mark.parametrize(("stop", "match"), [
    ("", "stop strings must be non-empty str, got \\[''\\]"),
    (["a", 3], "stop strings must be non-empty str, got \\[3\\]"),
    (5, "stop must be a str or a sequence of str, got int"),
    (b"ab", "stop must be a str or a sequence of str, got bytes"),
])
def test_bad_stop_strings_are_refused(stop, match):
    with pytest.raises(InvalidArgumentError, match=match):
        SamplingParams(stop=stop)


def test_one_string_is_one_stop():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["ab", "c"]).stop == ("ab", "c")
