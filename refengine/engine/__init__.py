"""The engine: sequences, the scheduler that plans each step, the executors that run it (a model, or
a step-cost model on a simulated clock), the loop that joins them, outputs and stats.

``from pagedbench.refengine.engine import LLM`` (the flat layout's ``refengine.engine``) still works;
it is imported lazily so that importing the scheduler pulls in no torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"LLM": "pagedbench.refengine.engine.llm", "ALLOCATORS": "pagedbench.refengine.engine.llm"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
