"""Two records of one study compared less where and when they were made (bench/common/record_diff.py)."""

from __future__ import annotations

import copy
import json

import pytest
from pagedbench.bench.common import record_diff

RECORD = {
    "schema_version": 2,
    "environment": {"created_utc": "2026-12-07T12:00:00+00:00", "git": {"commit": "a" * 40, "dirty": False}},
    "wall_s": 12.5,
    "results": [{"case": "small", "num_prompts": 8, "same_tokens": 8, "default_s": 1.25, "ratio": 1.1,
                 "rounds": 3, "step_ns": 1200, "samples_ms": [1.5, 2.5],
                 "capacity": {"2.0": 3.5}, "folder": "/work/wt-pre/models"}],
}


def _other() -> dict:
    """The same study's record from another run: its environment and wall time differ, nothing else."""
    b = copy.deepcopy(RECORD)
    b["environment"] = {"created_utc": "2026-12-07T13:00:00+00:00", "git": {"commit": "b" * 40, "dirty": True}}
    b["wall_s"] = 99.0
    return b


def test_environment_and_wall_time_are_not_differences():
    assert record_diff.diff_values(RECORD, _other()) == []


def test_a_planted_value_difference_is_reported_by_its_path():
    b = _other()
    b["results"][0]["capacity"]["2.0"] = 3.25
    assert record_diff.diff_values(RECORD, b) == ["results[0].capacity.2.0: 3.5 != 3.25"]


def test_timing_values_are_ignored_only_when_asked_and_counts_still_compared():
    b = _other()
    b["results"][0].update(default_s=2.5, ratio=1.3, step_ns=1400, samples_ms=[1.75, 2.5])
    assert len(record_diff.diff_values(RECORD, b)) == 4
    assert record_diff.diff_values(RECORD, b, ignore_timing=True) == []
    b["results"][0]["same_tokens"] = 7  # a count, not a time: still a difference
    assert record_diff.diff_values(RECORD, b, ignore_timing=True) == ["results[0].same_tokens: 8 != 7"]


@pytest.mark.parametrize(("change", "expected"), [
    (lambda r: r["results"][0].pop("ratio"), "results[0].ratio: present != absent"),
    (lambda r: r["results"].append({}), "results: 1 items != 2 items"),
    (lambda r: r["results"][0].update(default_s=None), "results[0].default_s: 1.25 != None"),
])
def test_the_shape_is_compared_even_with_timing_ignored(change, expected):
    b = _other()
    change(b)
    assert record_diff.diff_values(RECORD, b, ignore_timing=True) == [expected]


def test_same_maps_each_sides_folder():
    b = _other()
    b["results"][0]["folder"] = "/work/wt-post/models"
    assert record_diff.diff_values(RECORD, b) == ["results[0].folder: '/work/wt-pre/models' != '/work/wt-post/models'"]
    assert record_diff.diff_values(RECORD, b, same=(("/work/wt-pre", "/work/wt-post"),)) == []


def test_ignored_keys_are_left_out_wherever_they_are():
    b = _other()
    b["results"][0]["same_tokens"] = 7
    assert record_diff.diff_values(RECORD, b, ignore=frozenset({"same_tokens"})) == []
    assert record_diff.diff_values(RECORD, b, ignore=frozenset({"rounds"})) == ["results[0].same_tokens: 8 != 7"]


def test_numbers_in_strings_are_masked_only_with_timing_ignored():
    a, b = {"label": "fit, rescaled x0.993"}, {"label": "fit, rescaled x1.114"}
    assert record_diff.diff_values(a, b) == ["label: 'fit, rescaled x0.993' != 'fit, rescaled x1.114'"]
    assert record_diff.diff_values(a, b, ignore_timing=True) == []
    assert record_diff.diff_values(a, {"label": "fit, rescaled x-1.114"}, ignore_timing=True) == []  # a signed time
    assert record_diff.diff_values(a, {"label": "fit, scaled x1.114"}, ignore_timing=True) != []


def test_reports_drop_the_environment_block_and_mask_numbers_only_when_asked():
    a = ("# T\n\n| case | s    |\n|------|------|\n| small | 1.25 |\n\n- machine: AMD (2 cores)\n"
         "- commit: aaaa, generated 12:00\n")
    b = ("# T\n\n| case | s     |\n|------|-------|\n| small | 12.50 |\n\n- machine: Intel (2 cores)\n"
         "- commit: bbbb, generated 13:00\n")
    assert record_diff.diff_reports(a, b) == ["-| case | s    |", "-|------|------|", "-| small | 1.25 |",
                                              "+| case | s     |", "+|------|-------|", "+| small | 12.50 |"]
    assert record_diff.diff_reports(a, b, ignore_timing=True) == []
    assert record_diff.diff_reports(a, b.replace("small", "big"), ignore_timing=True) == ["-| small | # |",
                                                                                           "+| big | # |"]


def test_a_long_reports_blank_lines_still_match():
    a = "\n".join(["# T", ""] + [f"row {i}\n" for i in range(150)] + ["took 5 s", "", ""])
    assert record_diff.diff_reports(a, a.replace("took 5 s", "took 9 s")) == ["-took 5 s", "+took 9 s"]


def test_main_exits_1_on_a_difference_and_0_without(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(RECORD))
    b.write_text(json.dumps(_other()))
    assert record_diff.main([str(a), str(b)]) == 0
    changed = _other()
    changed["results"][0]["num_prompts"] = 9
    b.write_text(json.dumps(changed))
    assert record_diff.main([str(a), str(b), "--ignore-timing"]) == 1
    assert "results[0].num_prompts: 8 != 9" in capsys.readouterr().out


def test_main_names_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        record_diff.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert "no such file" in capsys.readouterr().err
