"""What ``LLM.generate`` tells a user while and after it runs: its progress bar on stderr (on by default
above 8 requests, silenced by ``use_tqdm=False``) and the timing figures of ``LLM.stats``."""

from __future__ import annotations

import time

import pytest
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.engine import progress
from pagedbench.refengine.engine.core import SimClock

MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, attention_backend="torch", seed=0)


def prompts(num: int) -> list[list[int]]:
    return [[1 + i % 60, 2, 3] for i in range(num)]


@pytest.mark.parametrize(("num", "use_tqdm", "shown"), [
    (9, None, True),  # the default: more than 8 requests
    (8, None, False),  # N-1 around the boundary
    (9, False, False),
    (30, False, False),
    (1, True, True),  # forced on for a single request
])
def test_progress_bar_on_stderr(loaded, capsys, num, use_tqdm, shown):
    llm = LLM(loaded, block_size=4, num_blocks=64)
    kwargs = {} if use_tqdm is None else {"use_tqdm": use_tqdm}
    outs = llm.generate(prompts(num), PARAMS, **kwargs)
    assert len(outs) == num
    captured = capsys.readouterr()
    assert captured.out == ""
    if shown:
        # tqdm ends on the last state it drew: every request finished, with the speed postfix
        assert f"{num}/{num}" in captured.err and "tok/s" in captured.err
    else:
        assert captured.err == ""


def test_progress_counts_requests_not_children(loaded, capsys):
    """A request with n=2 children advances the bar once, when its last child finishes."""
    llm = LLM(loaded, block_size=4, num_blocks=64)
    req = llm.core.new_request([1, 2, 3], SamplingParams(max_tokens=3, n=2, temperature=1.0))
    bar = progress.GenerateProgress([req], lambda: 0)
    first, second = req.children
    first.finish_reason = "length"
    bar.update([first])
    assert bar._bar.n == 0
    second.finish_reason = "length"
    bar.update([second])
    assert bar._bar.n == 1
    bar.update([first, second])  # a finished request is never counted again
    assert bar._bar.n == 1
    bar.close()
    llm.generate(prompts(2), SamplingParams(max_tokens=3, n=3, temperature=1.0, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "2/2" in err and "/6" not in err


def test_rejected_requests_are_not_in_the_bar(loaded, capsys):
    llm = LLM(loaded, block_size=4, num_blocks=64)
    outs = llm.generate([*prompts(9), []], PARAMS)  # the empty prompt is rejected
    assert outs[-1].error is not None
    assert "9/9" in capsys.readouterr().err


def test_progress_postfix_speed_counts_this_call_only(loaded, monkeypatch):
    """The postfix divides the tokens sampled since the bar opened by the seconds since then."""
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    total = [40]
    bar = progress.GenerateProgress([], lambda: total[0])
    now[0], total[0] = 102.0, 50
    bar.update([])
    assert bar._bar.postfix == "output 5.0 tok/s"
    bar.close()


def test_stats_timing_is_consistent(loaded, monkeypatch):
    llm = LLM(loaded, block_size=4, num_blocks=64)
    assert llm.stats.elapsed_s == 0.0 and llm.stats.output_tokens_per_s == 0.0
    before = time.perf_counter()
    llm.generate(prompts(4), PARAMS, use_tqdm=False)
    wall = time.perf_counter() - before
    s = llm.stats
    assert 0 < s.elapsed_s <= wall
    assert s.output_tokens_per_s == pytest.approx(s.num_generated_tokens / s.elapsed_s)
    assert s.input_tokens_per_s == pytest.approx(s.num_prompt_tokens / s.elapsed_s)
    assert (s.num_prompt_tokens, s.num_generated_tokens) == (12, 12)


def test_stats_elapsed_counts_generate_and_step_not_idle(loaded, monkeypatch):
    """Elapsed time is the engine clock's time inside generate and step calls: a step inside generate is
    not counted twice, and the time between calls is not counted."""
    llm = LLM(loaded, block_size=4, num_blocks=64)
    clock = llm.core.clock = SimClock()
    execute = llm.executor.execute

    def one_second_step(out):
        clock.advance(1.0)
        return execute(out)

    monkeypatch.setattr(llm.executor, "execute", one_second_step)
    llm.generate(prompts(2), PARAMS, use_tqdm=False)
    steps = llm.stats.num_steps
    assert steps >= 3 and llm.stats.elapsed_s == steps
    clock.advance(100.0)  # idle between calls
    llm.generate(prompts(1), PARAMS, use_tqdm=False)
    assert llm.stats.elapsed_s == llm.stats.num_steps
    req = llm.core.new_request([1, 2, 3], PARAMS)  # driven by hand: each step() is timed on its own
    llm.core.add(req)
    clock.advance(100.0)
    while llm.scheduler.has_unfinished():
        llm.step()
    s = llm.stats
    assert s.num_steps == steps + 6 and s.elapsed_s == s.num_steps
    assert s.output_tokens_per_s == s.num_generated_tokens / s.num_steps
