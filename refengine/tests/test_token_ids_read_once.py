"""A prompt's token ids are read once: where the request enters the engine (``EngineCore.new_request``, or
the caller that checked them), and the scheduler then tells the block manager not to read them again
(``allocate(check_tokens=False)``); a preempted sequence is admitted again without its prompt and output
read again, but with the one token it sampled after the manager last saw it read. Every id that reaches a
block table was read somewhere, and a bad one is refused naming it."""

from __future__ import annotations

import numpy as np
import pytest
from pagedbench.refengine import BlockManager, SamplingParams
from pagedbench.refengine.engine.core import EngineCore, SimClock, SimulatedExecutor
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule
from pagedbench.refengine.engine.sequence import Sequence
from pagedbench.refengine.errors import InvalidArgumentError


class _Spy(BlockManager):
    """A block manager that records each allocate's ``check_tokens``."""

    __slots__ = ("checks",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list[tuple[object, bool]] = []

    def allocate(self, seq_id, token_ids, *, check_tokens: bool = True, **kw):
        self.checks.append((seq_id, check_tokens))
        return super().allocate(seq_id, token_ids, check_tokens=check_tokens, **kw)


def _engine(num_blocks: int = 16, block_size: int = 4) -> tuple[_Spy, Scheduler, EngineCore]:
    bm = _Spy(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=False,
                      stop=StopRule(frozenset(), 64))
    return bm, sched, EngineCore(sched, SimulatedExecutor(lambda s: 0.0), clock=SimClock())


def test_allocate_without_the_check_takes_a_copy_and_checks_every_other_argument():
    bm = BlockManager(8, 4)
    tokens = [5, 6, 7]
    bm.allocate("a", tokens, check_tokens=False)
    tokens.append(8)  # the caller's list is its own
    assert bm.token_ids("a") == [5, 6, 7]
    bm.check_invariants()
    for call, problem in [
        (lambda: bm.allocate("b", [1], check_tokens="no"), "check_tokens must be a bool, got 'no'"),
        (lambda: bm.allocate("b", [1], check_tokens=0), "check_tokens must be a bool, got 0"),
        (lambda: bm.allocate("b", (1, 2), check_tokens=False), "must be a non-empty list, got tuple"),
        (lambda: bm.allocate("b", [], check_tokens=False), "must be a non-empty list, got an empty one"),
        (lambda: bm.allocate("b", [1], check_tokens=False, reserve_free_blocks=-1), "reserve_free_blocks"),
        (lambda: bm.allocate("b", [1], check_tokens=False, cache_salt=5), "salt"),
        (lambda: bm.allocate("a", [1], check_tokens=False), None),
    ]:
        with pytest.raises(Exception, match=problem) as e:
            call()
        if problem is not None:
            assert e.type is InvalidArgumentError
        assert not bm.has_sequence("b") and bm.num_free_blocks == 7  # nothing changed


def test_a_request_s_prompt_is_checked_where_it_enters():
    _, _, core = _engine()
    for bad, problem in [([0, -1, 3], r"got -1"), ([0, True], "bool"), ([0, 1.5], "ints"), ([], "at least 1")]:
        with pytest.raises(InvalidArgumentError, match=problem):
            core.new_request(bad, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgumentError, match="check_tokens must be a bool"):
        core.new_request([1], SamplingParams(max_tokens=2), check_tokens=None)
    assert core.next_request_id == 0 and core.next_seq_id == 0  # a refused request takes no id
    req = core.new_request([np.int64(4), 2], SamplingParams(max_tokens=2, n=2))
    assert [type(t) for t in req.children[1].token_ids] == [int, int] and req.prompt_token_ids == (4, 2)
    assert all(s.prompt_checked for s in req.children)
    # a request rejected with its reason keeps its ids as given (never allocated)
    assert core.new_request([-1], SamplingParams(max_tokens=2), error="too long").error == "too long"


def test_the_scheduler_vouches_only_for_ids_read_before():
    bm, sched, core = _engine()
    core.add(core.new_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    # a sequence made by hand (its prompt never read): the block manager reads it, and refuses a bad one
    sched.add(Sequence(100, 100, 0, [-1, 2], 2, SamplingParams(max_tokens=4), None))
    with pytest.raises(InvalidArgumentError, match="got -1"):
        core.step()
    assert bm.checks == [(0, False), (100, True)]  # the request's prompt was read where it entered
    assert not bm.has_sequence(100)


def test_a_preempted_sequence_s_last_token_is_read_on_its_readmission():
    bm, sched, core = _engine()
    core.add(core.new_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    core.step()  # its prefill, sampling a (good) token the manager has not seen
    (seq,) = sched.running
    sched._preempt(seq)
    out = sched.schedule()  # admitted again: its prompt and first output are not read again
    assert bm.checks == [(0, False), (0, False)] and bm.token_ids(0) == seq.token_ids
    sched.update(out, {0: -7})  # an executor's bad token, appended by the update (which reads none)
    sched._preempt(seq)  # preempted before the manager saw it
    with pytest.raises(InvalidArgumentError, match="got -7"):
        sched.schedule()
    assert bm.checks[-1] == (0, True) and not bm.has_sequence(0)
