"""What the model executor runs: the Llama-family model (``llama``), its config (``config``) and
loader, the attention backends and the sampler.

The names of the flat layout's ``refengine.model`` (``LlamaModel``, ``init_random_weights``...) are
re-exported lazily from ``llama``.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    module = importlib.import_module("pagedbench.refengine.model.llama")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
