"""Request groups in the serving simulator: parallel samples and replayed beams share blocks on the paged
manager (hand-computed peaks), every sample and beam reserves its own run on Orca's, groups are preempted
whole and leak nothing, a group is timed and counted as one request, and bad groups are refused."""

from __future__ import annotations

import pytest
from pagedbench.bench.sim.group_replay import BeamReplay, GroupSpec, PerBeamContiguousManager
from pagedbench.bench.sim.simulator import AllocatorSpec, SimConfig, simulate
from pagedbench.bench.workloads import Request, synthetic
from pagedbench.refengine import BlockManager

W = 4
PAGED = AllocatorSpec("paged", 16)
ORACLE = AllocatorSpec("orca", 1, "oracle", "first_fit")  # first fit: no buddy rounding in the numbers
# round 0 keeps the prompt W times; afterwards either every beam continues itself, or all descend from beam 0
SELF = (((0,) * W,) + ((0, 1, 2, 3),) * 3,)
COLLAPSE = (((0,) * W,) + ((0, 0, 0, 0),) * 3,)
ONE = (Request(0, 40, 30),)  # alone: its tables end at 40 + 30 - 1 = 69 tokens (the last is never stored)


def cfg(kv_slots: int = 4096, **kw) -> SimConfig:
    return SimConfig(kv_slots=kv_slots, max_seq_len=512, step_s=0.01, watermark=0.0, **kw)


def run(trace, spec, group, **kw):
    return simulate(trace, spec, kw.pop("config", cfg()), group=group, account=False, **kw)


@pytest.mark.parametrize("group", [GroupSpec("parallel", W), GroupSpec("beam", W, SELF)], ids=["n=4", "beam-self"])
def test_paged_group_shares_the_prompts_full_blocks(group):
    # 69 tokens = 4 full blocks + 5: the prompt's 2 full blocks (32 of its 40 tokens) are shared, the rest
    # (its partial block, copied on write, and the outputs) is each sequence's own: 2 + 4 x 3 blocks
    assert run(ONE, PAGED, group).peak_used_slots == (2 + W * 3) * 16


def test_paged_beams_collapsing_onto_one_parent_share_their_history():
    # every round forks beam 0 three times and frees the other three: all four share beam 0's full
    # blocks, and each holds its own partial block (copy-on-write): 4 + 4 blocks at the end
    assert run(ONE, PAGED, GroupSpec("beam", W, COLLAPSE)).peak_used_slots == (4 + W) * 16


@pytest.mark.parametrize("group", [GroupSpec("parallel", W), GroupSpec("beam", W, SELF),
                                   GroupSpec("beam", W, COLLAPSE)], ids=["n=4", "beam-self", "beam-collapse"])
def test_orca_reserves_for_every_sample_and_beam(group):
    made = []

    def manager(spec, config):
        made.append(PerBeamContiguousManager(config.kv_slots, 1, max_seq_len=config.max_seq_len, policy="oracle",
                                             placement="first_fit"))
        return made[0]

    r = run(ONE, ORACLE, group, make_manager=manager if group.is_beam else None)
    assert r.peak_used_slots == W * 70  # prompt + output each, nothing shared
    assert r.num_preemptions == 0  # a beam forked into a reservation as large as its parent's never outgrows it
    if group.trajectories is COLLAPSE:  # rounds 1..29 fork beam 0 three times: each a copy of its own
        assert made[0].num_fork_copies == 3 * 29
        assert made[0].num_copied_tokens == 3 * sum(40 + t for t in range(1, 30))
    assert made == [] or made[0].num_free_blocks == made[0].num_blocks


@pytest.mark.parametrize("spec", [PAGED, ORACLE], ids=["paged", "orca"])
@pytest.mark.parametrize("group", [GroupSpec("parallel", W), GroupSpec("beam", W, COLLAPSE)], ids=["n=4", "beam"])
def test_alone_a_group_advances_one_token_a_step(spec, group):
    r = run(ONE, spec, group)
    (t,) = r.requests
    assert t.finished and t.first_scheduled_s == 0.0
    assert t.token_times_s == pytest.approx([0.01 * (k + 1) for k in range(30)])  # the prompt step, then decodes
    assert r.mean_normalized_latency_s == pytest.approx(0.01)
    assert r.num_generated_tokens == W * 30


class _Watch:
    """Checks, after every step, the manager's invariants and that a request's live sequences are all
    running or all waiting (preemption and admission are per group)."""

    def __init__(self) -> None:
        self.bm = self.run = None
        self.num_checks = 0

    def manager(self, spec, config):
        if spec.kind == "paged":
            self.bm = BlockManager(config.kv_slots // spec.block_size, spec.block_size)
        else:
            self.bm = PerBeamContiguousManager(config.kv_slots, 1, max_seq_len=config.max_seq_len,
                                               policy=spec.policy, placement=spec.placement)
        return self.bm

    def check(self, sched) -> None:
        self.bm.check_invariants()
        by_request: dict[int, set] = {}
        for s in (*sched.running, *sched.waiting):
            by_request.setdefault(s.request_id, set()).add(s.status)
        assert all(len(states) == 1 for states in by_request.values()), by_request
        self.num_checks += 1


@pytest.mark.parametrize("spec", [PAGED, ORACLE], ids=["paged", "orca"])
def test_groups_under_memory_pressure_are_preempted_whole_and_leak_nothing(spec, monkeypatch):
    trace = synthetic("alpaca", 40, rate=50.0, seed=3, max_seq_len=256)
    traj = (((0,) * W, (0, 0, 1, 2), (0, 1, 2, 3), (1, 1, 1, 3)),)
    watch = _Watch()
    original = BeamReplay.after_step

    def after_step(self, report):
        done = original(self, report)
        watch.check(self.sched)
        return done

    monkeypatch.setattr(BeamReplay, "after_step", after_step)
    r = simulate(trace, spec, cfg(1200), group=GroupSpec("beam", W, traj), account=False,
                 make_manager=watch.manager)
    assert r.num_finished == len(trace) and all(t.finished for t in r.requests)
    assert watch.num_checks == r.num_steps
    if spec.kind == "paged":
        assert r.num_preemptions > 0  # the pool is small enough to preempt
    assert watch.bm.num_free_blocks == watch.bm.num_blocks


def test_a_group_completes_as_one_request_in_the_overload_test():
    # one request a second, each done in 30 steps of 10 ms: every arrival but the last completes in the window
    trace = tuple(Request(i, 20, 30, float(i)) for i in range(20))
    r = run(trace, PAGED, GroupSpec("parallel", W), config=cfg(warmup_frac=0.0))
    o = r.overload
    assert o.num_completions == o.num_arrivals - 1 and not o.overloaded
    assert r.num_finished == 20


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        GroupSpec("greedy", 2)
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        GroupSpec("parallel", 0)
    with pytest.raises(ValueError, match=r"round 1: expected 2 indices in \[0, 2\), got \[0, 2\]"):
        GroupSpec("beam", 2, (((0, 0), (0, 2)),))
    with pytest.raises(ValueError, match="at least one recorded trajectory"):
        GroupSpec("beam", 2)
    with pytest.raises(ValueError, match="4 sequences of 70 blocks each can never fit the pool's 200 blocks"):
        run(ONE, ORACLE, GroupSpec("parallel", 4), config=cfg(200))
    with pytest.raises(ValueError, match="double-counts the blocks a group shares"):
        simulate(ONE, PAGED, cfg(), group=GroupSpec("parallel", 2))
