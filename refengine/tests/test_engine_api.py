"""The engine's API around failures and control: ``generate`` returns every request after failed steps
(retried when asked), ``LLM.abort`` in every state of a request frees its blocks at once, and the
scheduler's settings are ``LLM`` arguments checked before the model loads."""

from __future__ import annotations

import pytest
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.engine.sequence import SequenceStatus
from pagedbench.refengine.errors import InvalidArgumentError

MODEL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, attention_backend="torch-batched", seed=1)


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 256 for i in range(n)]


def test_stepping_an_idle_engine_does_nothing(loaded):
    """A loop may step an engine with nothing queued (a server between requests, or after its last request
    finished): the step plans nothing, runs no model and changes no state."""
    llm = LLM(loaded, block_size=4, num_blocks=32, check_invariants=True)
    assert llm.step() == []
    (out,) = llm.generate([prompt(5, 1)], GREEDY)
    assert llm.step() == [] and llm.step() == []  # after the last request finished
    assert llm.stats.num_used_blocks == 0 and not llm.core.has_unfinished()
    assert llm.generate([prompt(5, 1)], GREEDY)[0].outputs[0].token_ids == out.outputs[0].token_ids


# --- generate after a failed step --------------------------------------------------------------------
def test_generate_returns_every_request_after_a_failed_step(loaded, monkeypatch):
    """A request finished before the failure is complete; one the failing step did not touch is served
    in full; the ones it touched carry the error and what they had generated."""
    prompts = [prompt(3, 1), prompt(6, 2), prompt(5, 3)]
    params = [SamplingParams(max_tokens=2, ignore_eos=True), GREEDY,
              SamplingParams(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True)]
    kw = dict(block_size=4, num_blocks=32, max_num_seqs=1, check_invariants=True)  # one at a time
    want = [o.outputs[0].token_ids for o in LLM(loaded, **kw).generate(prompts, params)]
    llm = LLM(loaded, **kw)
    real = llm.model.forward
    calls = []

    def forward(*args):  # request 0 ran steps 1-2; the 4th step is request 1's first decode
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("lost")
        return real(*args)

    monkeypatch.setattr(llm.model, "forward", forward)
    outs = llm.generate(prompts, params)
    assert [o.error for o in outs] == [None, "a step failed: RuntimeError: lost", None]
    assert outs[0].outputs[0].token_ids == want[0] and outs[2].outputs[0].token_ids == want[2]
    assert outs[1].outputs[0].finish_reason == "abort" and outs[1].outputs[0].token_ids == want[1][:1]
    assert llm.stats.num_used_blocks == 0

    # retried, every request is served in full, sampled ones included
    calls.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, max_step_retries=1)] == want


def test_retries_are_counted_per_request(loaded, monkeypatch):
    """A step failing every time ends each request after max_step_retries + 1 failures (no endless
    loop), every block given back."""
    llm = LLM(loaded, block_size=4, num_blocks=32)

    def broken(*args):
        raise RuntimeError("always")

    monkeypatch.setattr(llm.model, "forward", broken)
    outs = llm.generate([prompt(5, 1), prompt(9, 2)], GREEDY, max_step_retries=2)
    assert [o.error for o in outs] == ["a step failed: RuntimeError: always"] * 2
    assert [o.outputs[0].token_ids for o in outs] == [[], []]
    assert llm.scheduler.num_rollbacks == 3 and llm.stats.num_used_blocks == 0


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupts_propagate_after_cleanup(loaded, monkeypatch, exc):
    llm = LLM(loaded, block_size=4, num_blocks=32)
    want = [o.outputs[0].token_ids for o in llm.generate([prompt(5, 1)], GREEDY)]
    real = llm.model.forward
    calls = []

    def forward(*args):
        calls.append(1)
        if len(calls) == 2:
            raise exc()
        return real(*args)

    monkeypatch.setattr(llm.model, "forward", forward)
    with pytest.raises(exc):
        llm.generate([prompt(5, 1), prompt(7, 2)], GREEDY)
    assert llm.stats.num_used_blocks == 0 and not llm.scheduler.has_unfinished() and not llm.core.requests
    llm.block_manager.check_invariants()
    monkeypatch.setattr(llm.model, "forward", real)
    assert [o.outputs[0].token_ids for o in llm.generate([prompt(5, 1)], GREEDY)] == want


def test_a_broken_invariant_is_not_taken_for_a_failed_step(loaded):
    """A failure after a step succeeded (the invariant check) is a bug, not a request's error: generate
    raises it, leaving nothing queued."""
    llm = LLM(loaded, block_size=4, num_blocks=32, check_invariants=True)
    bm = llm.block_manager

    class Broken:
        def __getattr__(self, name):
            return getattr(bm, name)

        def check_invariants(self):
            raise AssertionError("ref counts differ")

    llm.block_manager = Broken()
    with pytest.raises(AssertionError, match="ref counts differ"):
        llm.generate([prompt(5, 1)], GREEDY, max_step_retries=3)
    assert bm.num_used_blocks == 0 and not llm.scheduler.has_unfinished()


def test_generate_argument_errors(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=32)
    for bad in (-1, 1.5, True, None):
        with pytest.raises(InvalidArgumentError, match=f"max_step_retries must be an int >= 0, got {bad!r}"):
            llm.generate([prompt(3, 1)], GREEDY, max_step_retries=bad)


# --- abort -------------------------------------------------------------------------------------------
def _running_decode(b) -> bool:
    return all(s.status is SequenceStatus.RUNNING for s in b.children) and b.children[0].num_output_tokens >= 2


def _preempted(b) -> bool:
    s = b.children[0]
    return s.status is SequenceStatus.WAITING and s.num_preemptions > 0 and s.num_output_tokens > 0


def _mid_prefill(b) -> bool:
    s = b.children[0]
    return s.status is SequenceStatus.RUNNING and 0 < s.num_computed_tokens < s.num_prompt_tokens


# state -> (LLM arguments, the aborted request's prompt and params, when to abort)
STATES = {
    "waiting": (dict(max_num_seqs=1), (prompt(6, 2), GREEDY), lambda b: b.children[0].num_computed_tokens == 0),
    "running": ({}, (prompt(6, 2), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)),
                _running_decode),
    "preempted": (dict(num_blocks=7), (prompt(6, 2), SamplingParams(max_tokens=14, ignore_eos=True)), _preempted),
    "mid-prefill": (dict(max_num_batched_tokens=4),
                    (prompt(13, 2), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)),
                    _mid_prefill),
}


@pytest.mark.parametrize("state", STATES)
def test_abort_in_every_state_frees_its_blocks_at_once(loaded, state):
    kw, (b_prompt, b_params), ready = STATES[state]
    kw = {"block_size": 4, "num_blocks": 32, "enable_prefix_caching": False, "check_invariants": True, **kw}
    a_prompt, a_params = prompt(5, 1), SamplingParams(max_tokens=12, ignore_eos=True)
    want_a = LLM(loaded, **kw).generate([a_prompt], a_params)[0].outputs[0].token_ids
    llm = LLM(loaded, **kw)
    llm.executor.check_block_tables = True
    core, bm = llm.core, llm.block_manager
    a, b = core.new_request(a_prompt, a_params), core.new_request(b_prompt, b_params)
    core.add(a)
    core.add(b)
    for _ in range(30):
        llm.step()
        if ready(b):
            break
    else:
        pytest.fail(f"never reached the {state} state")
    b_blocks = {blk for s in b.children if bm.has_sequence(s.seq_id) for blk in bm.block_table(s.seq_id)}
    if state in ("running", "mid-prefill"):
        assert b_blocks, "the aborted request was meant to hold blocks"
    used = bm.num_used_blocks
    assert llm.abort(b.request_id) is True
    assert bm.num_used_blocks == used - len(b_blocks)
    assert not any(bm.has_sequence(s.seq_id) for s in b.children)
    assert not any(s.request_id == b.request_id for s in (*llm.scheduler.running, *llm.scheduler.waiting))
    assert [c.finish_reason for c in b.output().outputs] == ["abort"] * b_params.n
    bm.check_invariants()
    assert llm.abort(b.request_id) is False  # already aborted
    while llm.scheduler.has_unfinished():
        llm.step()
    assert a.output().outputs[0].token_ids == want_a
    assert bm.num_used_blocks == 0
    assert llm.abort(a.request_id) is False  # finished


def test_abort_argument_errors(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=32)
    with pytest.raises(InvalidArgumentError, match="request_id must be an int, got str"):
        llm.abort("0")
    with pytest.raises(InvalidArgumentError, match=r"unknown request_id 0: this engine issued ids 0\.\.-1"):
        llm.abort(0)
    llm.generate([prompt(3, 1)], GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"unknown request_id -1"):
        llm.abort(-1)
    assert llm.abort(0) is False


def test_abort_all_keeps_working(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=32)
    reqs = [llm.core.new_request(prompt(6, i), GREEDY) for i in range(3)]
    for r in reqs:
        llm.core.add(r)
    llm.step()
    llm.abort_all()
    assert llm.block_manager.num_used_blocks == 0 and not llm.scheduler.has_unfinished()
    assert {c.finish_reason for r in reqs for c in r.output().outputs} == {"abort"}


# --- scheduler settings as LLM arguments -------------------------------------------------------------
def test_scheduler_settings_are_llm_arguments(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=32, policy="separate", watermark_blocks=3)
    assert (llm.scheduler.policy, llm.scheduler.watermark_blocks) == ("separate", 3)
    # separate: the first step is prompts only, the second prompt waits for none of the decodes
    llm.core.add(llm.core.new_request(prompt(5, 1), GREEDY))
    llm.step()
    llm.core.add(llm.core.new_request(prompt(5, 2), GREEDY))
    assert [c.num_tokens for c in llm.core.scheduler.schedule().chunks] == [5]


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="fcfs"), "policy must be one of mixed, separate; got 'fcfs'"),
    (dict(policy=None), "policy must be one of mixed, separate; got None"),
    (dict(watermark_blocks=-1), "watermark_blocks must be an int >= 0, got -1"),
    (dict(watermark_blocks=1.0), "watermark_blocks must be an int >= 0, got 1.0"),
    (dict(watermark_blocks=32), "watermark_blocks must be below the pool's 32 blocks"),
    (dict(watermark_blocks=2, allocator="contiguous"), "watermark_blocks applies to the paged allocator only"),
])
def test_scheduler_setting_errors(loaded, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(".", r"\.")):
        LLM(loaded, block_size=4, num_blocks=32, **kwargs)


def test_scheduler_settings_checked_before_loading(tmp_path):
    """A bad setting answers at once, not after the model loaded (the folder here does not exist)."""
    with pytest.raises(InvalidArgumentError, match="policy must be one of"):
        LLM(str(tmp_path / "no-such-model"), policy="fifo")
