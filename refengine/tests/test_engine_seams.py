"""Beam search builds its requests through the engine's public seams (``LLM.normalise_prompts``,
``LLM.prepare_prompt``), and imports nothing from the module of the ``LLM`` that imports it."""

from __future__ import annotations

import ast
from pathlib import Path

from pagedbench.refengine import LLM, SamplingParams
from pagedbench.refengine.cli import resolve_model

ENGINE = Path(__file__).resolve().parents[1] / "engine"


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_beam_search_does_not_import_the_llm_module():
    assert "pagedbench.refengine.engine.llm" not in imports(ENGINE / "beam_search.py")
    assert "pagedbench.refengine.engine.llm" not in imports(ENGINE / "prompts.py")


def test_prepare_prompt_gives_ids_salt_and_the_refusal():
    llm = LLM(resolve_model("tiny"), num_blocks=8, block_size=16)
    assert llm.prepare_prompt({"prompt_token_ids": [1, 2, 3], "cache_salt": "t"},
                              SamplingParams(max_tokens=4)) == ([1, 2, 3], "t", None)
    ids, _, error = llm.prepare_prompt([1, 2, 3], SamplingParams(max_tokens=200))
    assert ids == [1, 2, 3] and "can never fit the KV pool" in error
    assert llm.prepare_prompt({"prompt": 3}, SamplingParams())[2] == "'prompt' must be a string, got int"
    assert llm.block_manager.num_free_blocks == 8  # a question changes nothing


def test_the_server_does_not_import_the_cli():
    # the CLI starts the server (cli -> launch -> app); the server's chat rendering lives below both
    server = ENGINE.parent / "server"
    for path in server.glob("*.py"):
        assert "pagedbench.refengine.cli" not in imports(path), path.name
