"""Result files appear whole or not at all."""

from __future__ import annotations

import json
import os

import pytest
from pagedbench.bench.common import records


def test_write_json_replaces_whole(tmp_path):
    path = tmp_path / "r" / "x.json"
    records.write_json(path, {"a": 1})
    records.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.json"]  # no temporary left behind


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    records.write_json(path, {"old": True})

    def killed(*args):
        raise KeyboardInterrupt  # what a Ctrl-C between the write and the rename looks like

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        records.write_json(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
