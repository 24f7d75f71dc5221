"""The flat layout's module paths (``pagedbench.bench.serving_sim``...) still import, as the very module at
its new home, and still run with ``python -m``."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pagedbench.bench import MOVED_MODULES
from pagedbench.bench.module_aliases import RunnableMovedModuleFinder

BENCH = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_old_path_is_the_moved_module(old):
    new = f"pagedbench.bench.{MOVED_MODULES[old]}"
    module = importlib.import_module(f"pagedbench.bench.{old}")
    assert module is importlib.import_module(new)
    assert module.__name__ == new
    # the alias leaves the module's own spec (pickling, reloads and runpy read it)
    assert module.__spec__.name == new


def test_names_through_the_old_path_are_the_same_objects():
    from pagedbench.bench.serving_sim import SimConfig, simulate
    from pagedbench.bench.sim.records import SimConfig as new_config
    from pagedbench.bench.sim.simulator import simulate as new_simulate

    assert SimConfig is new_config and simulate is new_simulate


def test_python_m_runs_an_old_path_once_as_main():
    """runpy asks the alias's loader for the code (``get_code``): the module runs as ``__main__`` with its
    new file as ``__file__`` (its config's default path comes from that)."""
    run = subprocess.run([sys.executable, "-m", "pagedbench.bench.memory_study", "--help"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: python -m pagedbench.bench memory_study"), run.stdout
    default = re.search(r"YAML config \(default: (\S+)\)", run.stdout)
    assert default and Path(default.group(1)) == BENCH / "configs" / "memory.yaml", run.stdout


def test_a_map_entry_pointing_nowhere_is_named():
    finder = RunnableMovedModuleFinder("pagedbench.bench", {"gone": "sim.no_such_module"})
    with pytest.raises(ImportError, match=r"pagedbench\.bench\.gone moved to pagedbench\.bench\.sim\.no_such_module"):
        finder.find_spec("pagedbench.bench.gone")
    assert finder.find_spec("pagedbench.bench.not_moved") is None
