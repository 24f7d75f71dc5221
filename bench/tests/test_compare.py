"""``bench/compare.py``'s verdicts on synthetic timings (no benchmark runs): a slowdown beyond the noise
band of either side's own rounds regresses and fails the comparison, one inside it does not; A and B
alternate which goes first; each side imports from its own tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pagedbench.bench import compare

STEADY = [1.00, 1.01, 0.99, 1.02, 1.00]  # 3 % spread: the 5 % floor is the band


def scaled(k: float, samples=STEADY) -> list[float]:
    return [k * s for s in samples]


@pytest.mark.parametrize(("b", "verdict"), [
    (STEADY, "same"),  # control
    (scaled(1.04), "same"),  # inside the floor
    (scaled(1.06), "regressed"),  # just past it
    (scaled(1.30), "regressed"),
    (scaled(1 / 1.04), "same"),
    (scaled(1 / 1.06), "improved"),
])
def test_verdict_against_a_steady_base(b, verdict):
    v = compare.judge("x", STEADY, b)
    assert v.verdict == verdict
    assert v.ratio == pytest.approx(b[0] / STEADY[0]) and v.band == pytest.approx(0.05)


def test_noisy_base_widens_the_band_and_a_wide_band_is_too_noisy_to_call_same():
    noisy_a = [1.0, 1.4, 0.9, 1.1, 1.0]  # spread (1.4 - 0.9) / 1.0 = 50 %
    v = compare.judge("x", noisy_a, scaled(1.3))
    assert v.band == pytest.approx(0.5) and v.verdict == "too noisy to judge"
    assert compare.judge("x", noisy_a, scaled(1.3), max_band=0.6).verdict == "same"
    assert compare.judge("x", noisy_a, scaled(1.6)).verdict == "regressed"  # beyond even a wide band


def test_noisy_b_widens_the_band_too():
    noisy_b = [1.30, 1.80, 1.20, 1.25, 1.30]  # median 1.3, spread 0.6 / 1.3
    v = compare.judge("x", STEADY, noisy_b)
    assert v.band == pytest.approx(0.6 / 1.3) and v.verdict == "too noisy to judge"


def test_the_run_states_the_smallest_change_it_could_detect():
    noisy_a = [1.0, 1.4, 0.9, 1.1, 1.0]
    verdicts = compare.judge_all({"calm": STEADY, "noisy": noisy_a, "gone": STEADY},
                                 {"calm": STEADY, "noisy": noisy_a})
    line = compare.detectable(verdicts, 0.2)
    assert line.startswith("smallest change this run could detect: ±5.0% (best benchmark), "
                           "±27.5% (median over 2)")
    assert "1 benchmark(s) too noisy to judge (band above ±20%)" in line
    assert "too noisy" not in compare.detectable(compare.judge_all({"t": STEADY}, {"t": STEADY}), 0.2)
    assert "nothing could be detected" in compare.detectable([], 0.2)


def test_min_band_is_a_floor():
    assert compare.judge("x", STEADY, scaled(1.06), min_band=0.10).verdict == "same"


def test_median_not_mean_so_one_disturbed_round_does_not_decide():
    b = [1.0, 1.01, 0.99, 1.02, 9.0]  # one round hit by another job
    v = compare.judge("x", STEADY, b)
    assert v.b_median_s == pytest.approx(1.01)


def test_judge_all_and_failure():
    a = {"kept": STEADY, "slower": STEADY, "dropped": STEADY}
    b = {"kept": STEADY, "slower": scaled(1.5), "added": STEADY}
    verdicts = {v.name: v.verdict for v in compare.judge_all(a, b)}
    assert verdicts == {"added": "only on B", "dropped": "missing on B", "kept": "same", "slower": "regressed"}
    assert compare.failed(compare.judge_all(a, b))
    assert not compare.failed(compare.judge_all({"kept": STEADY}, {"kept": STEADY, "added": STEADY}))
    assert compare.failed(compare.judge_all({"kept": STEADY}, {}))  # this tree can no longer run it


def test_rounds_alternate_who_goes_first():
    assert [compare.round_order(r) for r in range(4)] == [("A", "B"), ("B", "A"), ("A", "B"), ("B", "A")]


def test_table_has_every_column():
    text = compare.table(compare.judge_all({"t": STEADY}, {"t": scaled(2.0)}))
    header, _, row = text.splitlines()
    for column in ("benchmark", "A median (µs)", "B median (µs)", "B/A", "detectable (band)", "verdict"):
        assert column in header
    assert row.split() == ["t", "1,000,000.0", "2,000,000.0", "2.000", "±5.0%", "regressed"]


def test_each_side_imports_from_its_own_tree(tmp_path):
    tree = Path(compare.__file__).resolve().parents[1]  # the folder holding refengine/, bench/...
    root = compare.import_root(tree, tmp_path / "side")
    env = {**os.environ, "PYTHONPATH": str(root)}
    compare.check_imports(root, env)  # passes: pagedbench.refengine comes from root
    empty = compare.import_root(tmp_path / "no-packages", tmp_path / "empty")
    with pytest.raises(SystemExit, match=r"does not import as pagedbench\.refengine"):
        compare.check_imports(empty, env | {"PYTHONPATH": str(empty)})
