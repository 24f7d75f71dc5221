"""PagedBench's reference engine: block pool, block manager, contiguous baselines, scheduler, model, LLM.

Public names are re-exported here and imported lazily, so ``from refengine import BlockManager`` does
not pull in the model or the kernels.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BlockManager": "refengine.block_manager",
    "BlockManagerMetrics": "refengine.block_manager",
    "BlockPool": "refengine.block_pool",
    "ContiguousBlockManager": "refengine.contiguous",
    "LLM": "refengine.engine",
    "SamplingParams": "refengine.sampling",
    "RequestOutput": "refengine.outputs",
    "CompletionOutput": "refengine.outputs",
    "ModelConfig": "refengine.model_config",
    "load_model": "refengine.loader",
    "LoadedModel": "refengine.loader",
    "AttentionMetadata": "refengine.attention_backend",
    "get_attention_backend": "refengine.attention_backend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'refengine' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
