"""The beam study's replay of beam trajectories on the real block manager (Figure 15's method)."""

from __future__ import annotations

import pytest
from pagedbench.bench.sim.sharing import sharing_saving
from pagedbench.bench.studies.beam import study as beam_study
from pagedbench.bench.workloads import Request


def test_beams_that_never_merge_save_what_parallel_sampling_saves():
    """Round 0 forks the prompt, every later round keeps each beam once: parallel sampling's sharing."""
    trace = (Request(0, 21, 40), Request(1, 5, 17), Request(2, 16, 16))
    for width in (2, 4):
        traj = [[0] * width] + [list(range(width))] * 7
        assert beam_study.beam_sharing_saving(trace, width, 4, [traj]) == pytest.approx(
            sharing_saving(trace, width, 4), abs=1e-12)


def test_collapsing_beams_fork_copy_on_write_and_free():
    """Prompt of 4 (one full block of 4), 2 beams, both kept from beam 0 every round.
    Round 0: 2 beams on the prompt block, each appends into a new block: 3 used, 2 x 2 unshared.
    Round 1: beam 0 forks, beam 1 is freed, the fork copies the shared partial block on write: 3 used,
    2 x 2 unshared. Saving 1 - 6 / 8."""
    got = beam_study.beam_sharing_saving((Request(0, 4, 2),), 2, 4, [[[0, 0], [0, 0]]])
    assert got == pytest.approx(0.25, abs=1e-12)


def test_recorded_trajectories_have_the_search_shape():
    cfg = beam_study.BeamStudyConfig(num_trajectories=1, trajectory_rounds=4)
    (traj,) = beam_study.record_trajectories(cfg, 3)
    assert len(traj) == 4 and traj[0] == [0, 0, 0]  # the first round: every beam from the prompt
    assert all(len(kept) == 3 and all(0 <= i < 3 for i in kept) for kept in traj)
