"""No source or config file in the project's folders is hidden from git by an ignore rule.

A file that ``.gitignore`` swallows works here and is missing from every clean clone (CI, a user's
checkout): an unanchored ``models/`` once ignored ``bench/configs/models/*.yaml`` that tests load.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("refengine", "kernels", "conformance", "bench", "results")
SOURCE_SUFFIXES = {".py", ".yaml", ".yml", ".json", ".md", ".csv", ".txt", ".toml", ".jinja", ".svg", ".png"}


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_no_source_file_is_ignored():
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--others", "--ignored", "--exclude-standard",
                          "--", *FOLDERS], capture_output=True, text=True, timeout=60, check=True).stdout
    hidden = [line for line in out.splitlines()
              if Path(line).suffix in SOURCE_SUFFIXES and "__pycache__" not in line and "/tmp/" not in line]
    assert not hidden, f"ignored by .gitignore, so absent from a clean clone: {hidden}"
