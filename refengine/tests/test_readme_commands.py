"""The README's first commands run as written in a fresh shell: each is a `make` target the Makefile has,
or the project's own interpreter (``.venv/bin/python``, nothing that needs an activated venv) with
arguments the CLI accepts; and its Python example reads the folder ``make model`` writes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from pagedbench.refengine.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def start_here_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Start here", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [line.split("  #", 1)[0].strip() for line in joined.splitlines() if line.strip()]


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))


def test_start_here_has_commands():
    assert len(start_here_commands()) >= 5


@pytest.mark.parametrize("command", start_here_commands())
def test_each_command_runs_in_a_fresh_shell(command):
    words = shlex.split(command)
    if words[0] == "make":
        assert words[1] in make_targets(), f"`{command}`: no such Makefile target"
        return
    assert words[0] == ".venv/bin/python", f"`{command}` needs an activated venv; name .venv/bin/python"
    assert words[1:3] == ["-m", "pagedbench.refengine"]
    build_parser().parse_args(words[3:])  # exits (fails the test) on an option the CLI does not have


def test_the_python_example_reads_make_models_folder():
    text = (ROOT / "README.md").read_text()
    example = text.split("## The engine", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'LLM("./models/SmolLM2-135M-Instruct"' in example and "~/" not in example
