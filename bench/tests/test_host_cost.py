"""The host-cost bench's validity verdict: a machine slowed down uniformly invalidates the run, which an
interquartile-range filter alone cannot see."""

from __future__ import annotations

from pagedbench.bench.studies.host_cost import study as host_cost


def test_a_uniform_slowdown_invalidates_the_run():
    assert host_cost.machine_speed_reasons(0.010, 0.011, 0.5, 2) == []  # 10% drift: steady enough
    slowed = host_cost.machine_speed_reasons(0.010, 0.020, 0.5, 2)
    assert len(slowed) == 1 and "machine speed changed during the run" in slowed[0] and "100%" in slowed[0]
    sped_up = host_cost.machine_speed_reasons(0.020, 0.010, 0.5, 2)
    assert "machine speed changed" in sped_up[0]


def test_a_busy_machine_invalidates_the_run():
    assert host_cost.machine_speed_reasons(0.01, 0.01, 3.5, 2) == ["machine busy: load average 3.5 on 2 cores"]


def test_the_reference_loop_measures_something():
    t = host_cost.reference_loop_s(repeats=1)
    assert 0 < t < 5
