"""The capacity search to a stated resolution (upwards and downwards) on synthetic latency curves whose
capacity is known, and the estimates over replicates: log-scale intervals that never reach 0, paired
ratios that decide where independent intervals cannot, ties only where the paired interval holds 1."""

from __future__ import annotations

import math
import random

import pytest
from pagedbench.bench.sim.capacity_search import (
    compare,
    estimate,
    find_capacity,
    known_bracket,
    log_estimate,
    needs_more_replicates,
    paired_verdict,
    ratio_estimate,
    relative_half_width,
)


def latency_curve(knee: float):
    """An M/M/1-like normalized latency: 1 at no load, growing as 1 / (1 - rate / knee), infinite past
    the knee; at threshold 2x the low-load value the capacity is knee / 2 exactly."""
    def latency(rate: float) -> float:
        return math.inf if rate >= knee else 1.0 / (1.0 - rate / knee)
    return latency


@pytest.mark.parametrize("knee", [0.37, 3.0, 41.0, 900.0])
def test_the_capacity_is_found_within_two_percent(knee):
    latency = latency_curve(knee)
    calls = []

    def passes(rate):
        calls.append(rate)
        return latency(rate) <= 2.0

    c = find_capacity(passes, 0.05, resolution=0.02)
    true = knee / 2
    assert c.rate <= true < c.bracket[1]  # the capacity is a measured passing rate, the knee within the bracket
    assert c.resolution <= 0.02 and c.rate >= true / 1.02
    assert len(calls) <= 30


def test_a_first_rate_above_the_capacity_is_searched_downwards():
    latency = latency_curve(2.0)  # capacity 1.0
    c = find_capacity(lambda r: latency(r) <= 2.0, 50.0, resolution=0.02, min_rate=1e-3)
    assert c.rate <= 1.0 < c.bracket[1] and c.resolution <= 0.02
    # without a floor the old answer stands: no capacity, with the reason
    assert find_capacity(lambda r: latency(r) <= 2.0, 50.0).reason == "fails already at the first rate 50"
    none = find_capacity(lambda r: False, 50.0, min_rate=1.0)
    assert none.rate is None and none.reason == "fails at every rate down to 1, the search's floor"


def _counted(latency, threshold, seen):
    def passes(rate):
        seen.append(rate)
        return latency(rate) <= threshold
    return passes


@pytest.mark.parametrize("knee", [0.37, 41.0])
def test_a_second_criterion_bisects_from_the_first_ones_points(knee):
    latency = latency_curve(knee)
    first: list[float] = []
    find_capacity(_counted(latency, 2.0, first), 0.05, resolution=0.02)
    known = {r: latency(r) <= 1.8 for r in first}  # the second criterion's verdicts at the rates already run
    again: list[float] = []
    c = find_capacity(_counted(latency, 1.8, again), 0.05, resolution=0.02, known=known)
    true = knee * (1 - 1 / 1.8)
    assert c.rate <= true < c.bracket[1] and c.resolution <= 0.02
    fresh: list[float] = []
    find_capacity(_counted(latency, 1.8, fresh), 0.05, resolution=0.02)
    assert not set(again) & set(first)  # no rate already run is run again
    assert len(again) < len(fresh) - 2  # and the bracketing steps are saved


def test_known_bracket_is_the_first_crossing_from_below():
    assert known_bracket({1.0: True, 2.0: False, 3.0: True, 4.0: False}) == (1.0, 2.0)
    assert known_bracket({1.0: True, 2.0: True}) is None  # nothing failed: no bracket
    assert known_bracket({1.0: False, 2.0: False}) is None  # nothing passed below a failure


@pytest.mark.parametrize(("guess", "most_points"), [(5.1, 7), (4.6, 7), (0.5, 14), (80.0, 14)])
def test_a_guessed_capacity_is_bracketed_near_it_and_still_found_when_wrong(guess, most_points):
    latency = latency_curve(10.0)  # capacity 5 at 2x
    seen: list[float] = []
    c = find_capacity(_counted(latency, 2.0, seen), guess / 1.1, factor=1.21, resolution=0.02, widen=True,
                      min_rate=1e-3)
    assert c.rate <= 5.0 < c.bracket[1] and c.resolution <= 0.02
    assert len(seen) <= most_points
    cold: list[float] = []
    find_capacity(_counted(latency, 2.0, cold), 0.05, resolution=0.02)
    if abs(math.log(guess / 5.0)) < 0.1:
        assert len(seen) < len(cold) - 2  # a good guess saves the bracketing


def test_resolution_and_floor_are_checked():
    with pytest.raises(ValueError, match="resolution must be > 0, got 0"):
        find_capacity(lambda r: True, 1.0, resolution=0)
    with pytest.raises(ValueError, match=r"min_rate must be in \(0, start=1\], got 2"):
        find_capacity(lambda r: True, 1.0, min_rate=2.0)


def test_log_estimate_never_reaches_zero_where_the_plain_one_does():
    values = [0.5, 9.0, 41.0]
    assert estimate(values).low < 0  # the interval the old report printed as "[0, 41]"
    e = log_estimate(values)
    assert 0 < e.low < e.mean < e.high
    assert e.mean == pytest.approx((0.5 * 9.0 * 41.0) ** (1 / 3))
    with pytest.raises(ValueError, match="positive values"):
        log_estimate([1.0, 0.0])


def replicate_capacities(seed: int, knee_ratio: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """One replicate's (capacity, failing rate) for two managers served the same arrivals: the trace's
    luck moves both knees together (a factor of 0.6-1.6), the managers differ by ``knee_ratio`` and a
    little noise of their own."""
    rng = random.Random(seed)
    common = math.exp(rng.uniform(math.log(0.6), math.log(1.6)))
    knees = (10.0 * common * knee_ratio * math.exp(rng.gauss(0, 0.01)), 10.0 * common)
    out = []
    for knee in knees:
        lat = latency_curve(knee)
        c = find_capacity(lambda r, lat=lat: lat(r) <= 2.0, 0.1, resolution=0.02)
        out.append((c.rate, c.bracket[1]))
    return out[0], out[1]


def test_paired_replicates_decide_where_independent_intervals_tie():
    ours, theirs = zip(*(replicate_capacities(s, 1.15) for s in range(4)))
    # independently, the trace-to-trace spread swamps a 15% difference ...
    assert compare(log_estimate([c for c, _ in ours]), log_estimate([c for c, _ in theirs])) == "tie"
    # ... paired, it cancels: the ratio's interval excludes 1 and holds the true 1.15
    ratio = ratio_estimate(list(ours), list(theirs))
    assert paired_verdict(ratio) == "higher" and ratio.low <= 1.15 <= ratio.high
    assert relative_half_width(ratio) < 0.05


def test_replicates_are_added_until_every_estimate_is_within_five_percent():
    caps: dict[str, list] = {"ours": [], "theirs": []}
    seed = 0
    while True:
        a, b = replicate_capacities(seed, 1.3)
        caps["ours"].append(a)
        caps["theirs"].append(b)
        seed += 1
        if seed < 3:
            continue
        estimates = {"ratio": ratio_estimate(caps["ours"], caps["theirs"]),
                     "ours": log_estimate([c for c, _ in caps["ours"]])}
        wide = needs_more_replicates(estimates, 0.05)
        if not wide or seed >= 200:
            break
    assert not wide, f"still wider than +-5% after {seed} replicates: {wide}"
    assert all(relative_half_width(e) <= 0.05 for e in estimates.values())
    assert estimates["ratio"].low <= 1.3 <= estimates["ratio"].high


def test_a_tie_is_called_only_when_the_paired_interval_holds_one():
    from pagedbench.bench.sim.capacity_search import Estimate

    assert paired_verdict(Estimate(1.0, 0.97, 1.03, 5)) == "tie"
    assert paired_verdict(Estimate(1.1, 1.01, 1.2, 5)) == "higher"
    assert paired_verdict(Estimate(0.9, 0.8, 0.99, 5)) == "lower"
    assert paired_verdict(Estimate(1.0, 1.0, 1.0, 5)) == "tie"


def test_needs_more_replicates_names_the_wide_ones_widest_first():
    from pagedbench.bench.sim.capacity_search import Estimate

    e = {"narrow": Estimate(1.0, 0.98, 1.02, 6), "wide": Estimate(1.0, 0.5, 2.0, 6),
         "wider": Estimate(1.0, 0.2, 5.0, 6), "one": Estimate(1.0, 1.0, 1.0, 1)}
    assert needs_more_replicates(e, 0.05) == ["one", "wider", "wide"]
