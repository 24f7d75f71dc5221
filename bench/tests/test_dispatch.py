"""``python -m pagedbench.bench NAME``: a study's main may return its record; only an int is an exit status."""

from __future__ import annotations

import json
import types

import pytest
from pagedbench.bench import __main__ as bench_main


@pytest.mark.parametrize(("returned", "status"), [({"record": 1}, 0), (None, 0), (0, 0), (3, 3)])
def test_a_study_returning_its_record_exits_0(monkeypatch, returned, status):
    fake = types.SimpleNamespace(main=lambda argv: returned)
    monkeypatch.setattr(bench_main.importlib, "import_module", lambda name: fake)
    assert bench_main.main(["costmodel.vidur_fit", "--out", "unused"]) == status


def test_a_whole_run_records_each_studys_time_and_the_load(monkeypatch, tmp_path):
    ran = []
    fake = types.SimpleNamespace(main=lambda argv: ran.append(argv))
    monkeypatch.setattr(bench_main, "STUDIES", ("a", "b"))
    monkeypatch.setattr(bench_main, "STUDY_MODULES", {"a": "x", "b": "y"})
    real = bench_main.importlib.import_module  # the studies and the headline page are faked, the rest real
    monkeypatch.setattr(bench_main.importlib, "import_module",
                        lambda name: fake if name.startswith("pagedbench.bench.") else real(name))
    monkeypatch.setattr(bench_main, "RESULTS_DIR", tmp_path)
    loads = iter([0.5, 1.5, 2.5, 9.0, 9.0])
    monkeypatch.setattr(bench_main, "_load_average", lambda: next(loads))
    assert bench_main.main([]) == 0
    doc = json.loads((tmp_path / "bench_run.json").read_text())
    assert [s["study"] for s in doc["studies"]] == ["a", "b"] and ran == [[], [], []]  # a, b, the headline
    assert [s["load_after"] for s in doc["studies"]] == [1.5, 2.5] and doc["load_before"] == 0.5
    assert doc["total_s"] == sum(s["wall_s"] for s in doc["studies"])
    text = (tmp_path / "bench_run.md").read_text()
    assert text.startswith("# `make bench`: ") and "Load average before the run: 0.5" in text
    monkeypatch.setattr(bench_main, "RESULTS_DIR", tmp_path / "only")
    bench_main.main(["--only", "a"])  # a partial run says nothing of make bench's time
    assert not (tmp_path / "only").exists()
