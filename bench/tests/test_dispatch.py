"""``python -m pagedbench.bench NAME``: a study's main may return its record; only an int is an exit status."""

from __future__ import annotations

import types

import pytest
from pagedbench.bench import __main__ as bench_main


@pytest.mark.parametrize(("returned", "status"), [({"record": 1}, 0), (None, 0), (0, 0), (3, 3)])
def test_a_study_returning_its_record_exits_0(monkeypatch, returned, status):
    fake = types.SimpleNamespace(main=lambda argv: returned)
    monkeypatch.setattr(bench_main.importlib, "import_module", lambda name: fake)
    assert bench_main.main(["costmodel.vidur_fit", "--out", "unused"]) == status
