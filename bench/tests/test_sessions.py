"""Multi-turn sessions and few-shot prefixes (bench/workloads/sessions.py) and the simulator's follow-ups
(bench/sim/follow_ups.py): a turn arrives exactly its think time after the turn before it completes, a
history is cut to its last N tokens, and a shared prefix's ids are the same in every request."""

from __future__ import annotations

import numpy as np
import pytest
from pagedbench.bench.sim.follow_ups import FollowUps
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.bench.workloads import Request, sessions

PAGED = AllocatorSpec("paged", 16)


def _conversation(think_s: float, max_history: int | None = None) -> sessions.SessionTrace:
    shape = sessions.MultiTurnShape(3, 4, (20, 40), (5, 9), think_s=think_s, max_history=max_history)
    return sessions.multi_turn(shape, rate=2.0, seed=3)


@pytest.mark.parametrize("think_s", [0.0, 1.75])
def test_a_turn_arrives_its_think_time_after_the_previous_turn_completes(think_s):
    trace = _conversation(think_s)
    r = simulate(trace.requests, PAGED, SimConfig(kv_slots=4096, step_s=0.03), prompt_tokens=trace.prompt_tokens)
    timing = {t.request_id: t for t in r.requests}
    assert len(timing) == len(trace.requests) and all(t.finished for t in timing.values())
    follow_ups = [q for q in trace.requests if q.release_after is not None]
    assert len(follow_ups) == 9
    for q in follow_ups:
        before = timing[q.release_after]
        assert timing[q.request_id].arrival_s == before.token_times_s[-1] + think_s
        assert timing[q.request_id].first_scheduled_s >= timing[q.request_id].arrival_s
    for q in trace.requests:  # first rounds keep their own times
        if q.release_after is None:
            assert timing[q.request_id].arrival_s == q.arrival_s


def test_a_follow_up_arrival_is_the_same_under_fast_forward():
    trace = _conversation(0.5)
    runs = [simulate(trace.requests, PAGED, SimConfig(kv_slots=4096, step_s=0.03), prompt_tokens=trace.prompt_tokens,
                     fast_forward=ff) for ff in (True, False)]
    assert [(t.arrival_s, t.token_times_s) for t in runs[0].requests] == \
        [(t.arrival_s, t.token_times_s) for t in runs[1].requests]


def test_the_history_is_cut_to_its_last_n_tokens():
    user = np.array([[30, 30, 30, 30]])
    answer = np.array([[20, 20, 20, 20]])
    whole = sessions.conversations(user, answer, [0.0])
    cut = sessions.conversations(user, answer, [0.0], max_history=64)
    for q_whole, q_cut in zip(whole.requests, cut.requests):
        ids = whole.token_ids[q_whole.request_id]
        assert q_whole.prompt_len == len(ids) == [30, 80, 130, 180][q_whole.request_id]
        assert cut.token_ids[q_cut.request_id] == ids[-64:]
        assert q_cut.prompt_len == min(64, len(ids))
    # a turn repeats the previous prompt and its answer (the filler the simulator generates), then new ids
    second = whole.token_ids[1]
    assert second[:30] == whole.token_ids[0] and second[30:50] == (sessions.FILLER_TOKEN,) * 20
    assert not set(second[50:]) & set(whole.token_ids[0])


def test_sessions_share_only_their_own_history():
    trace = _conversation(0.0)
    first = {q.request_id: set(trace.token_ids[q.request_id]) for q in trace.requests if q.release_after is None}
    assert all(not a & b for i, a in first.items() for j, b in first.items() if i < j)


@pytest.mark.parametrize(("shots", "prefix_len"), [(1, 80), (5, 341)])
def test_a_shared_prefix_has_the_same_ids_in_every_request(shots, prefix_len):
    trace = sessions.few_shot(shots, 50, rate=5.0, seed=1)
    tokens = sessions.workload(f"fewshot-{shots}").prompt_tokens
    ids = [tokens(q) for q in trace]
    assert all(len(i) == q.prompt_len > prefix_len for i, q in zip(ids, trace))
    assert len({tuple(i[:prefix_len]) for i in ids}) == 1
    assert len(set(ids[0][:prefix_len])) > prefix_len // 2  # a real draw, not one repeated id
    own = [set(i[prefix_len:]) for i in ids]
    assert all(not own[a] & own[b] for a in range(len(own)) for b in range(a + 1, len(own)))


def test_a_shared_prefix_is_served_from_the_prefix_cache():
    trace = sessions.few_shot(5, 40, rate=2.0, seed=2)  # one at a time: the first publishes it
    tokens = sessions.workload("fewshot-5").prompt_tokens
    bms = []

    def manager(spec, cfg):
        from pagedbench.refengine import BlockManager
        bms.append(BlockManager(cfg.kv_slots // spec.block_size, spec.block_size, enable_prefix_caching=True))
        return bms[-1]

    simulate(trace, PAGED, SimConfig(kv_slots=16384, enable_prefix_caching=True), prompt_tokens=tokens,
             make_manager=manager, account=False)
    m = bms[0].metrics()
    # every request after the first finds the prefix's 21 full blocks (341 // 16) cached
    assert m.prefix_hit_tokens >= 39 * 21 * 16


def test_follow_ups_that_cannot_be_released_are_refused():
    with pytest.raises(ValueError, match="follows request 9, which is not in the trace"):
        FollowUps((Request(0, 4, 2), Request(1, 4, 2, release_after=9)))
    with pytest.raises(ValueError, match="cycle"):
        FollowUps((Request(0, 4, 2, release_after=1), Request(1, 4, 2, release_after=0)))
    trace = _conversation(0.0)
    with pytest.raises(ValueError, match="span_s must be None"):
        simulate(trace.requests, PAGED, SimConfig(kv_slots=4096, span_s=100.0), prompt_tokens=trace.prompt_tokens)


def test_bad_session_shapes_are_refused():
    with pytest.raises(ValueError, match="user_lens must be ints >= 1"):
        sessions.conversations(np.array([[0, 3]]), np.array([[1, 1]]), [0.0])
    with pytest.raises(ValueError, match="max_history must be an int >= 1"):
        sessions.conversations(np.array([[2]]), np.array([[1]]), [0.0], max_history=0)
    with pytest.raises(ValueError, match="shots must be one of"):
        sessions.few_shot(3, 4)
    with pytest.raises(ValueError, match="unknown workload"):
        sessions.workload("nope")
