"""``make help`` prints each target with its whole comment, however many lines the Makefile spreads it over."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None or not (ROOT / "Makefile").is_file(), reason="no make here")
def test_every_help_line_is_whole():
    out = subprocess.run(["make", "-s", "-C", str(ROOT), "help"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("  make ")}
    # the test target's comment spans two Makefile lines: its second half is printed too
    assert lines["test"].rstrip().endswith("The fuller grids are behind `slow` (`make test-full`).")
    assert "installs nothing from the network" in lines["gpu-check"]
