"""PagedBench's reference engine, cut along the data flow:

- ``refengine.kv``: KV memory (block pool, free queue, prefix hashes, the paged block manager, the
  contiguous/Orca managers and their arena). No torch, except the block pool's views.
- ``refengine.engine``: requests and sequences, the scheduler, the engine loop and its executors,
  outputs and stats. The scheduler and the sequences import no torch.
- ``refengine.model``: the Llama-family model, its config and loader, the attention backends and the
  sampler: what the model executor runs.

Public names are re-exported here and imported lazily, so ``from pagedbench.refengine import
BlockManager`` does not pull in the model or the kernels. The flat module paths of earlier versions
(``refengine.block_manager``, ``refengine.scheduler``...) still import: they are aliases of the modules'
new homes.
"""

from __future__ import annotations

import importlib

from pagedbench.refengine.module_aliases import install

_EXPORTS = {
    "BlockManager": "pagedbench.refengine.kv.block_manager",
    "BlockManagerMetrics": "pagedbench.refengine.kv.block_manager",
    "BlockPool": "pagedbench.refengine.kv.block_pool",
    "ContiguousBlockManager": "pagedbench.refengine.kv.contiguous",
    "LLM": "pagedbench.refengine.engine.llm",
    "SamplingParams": "pagedbench.refengine.engine.sampling_params",
    "BeamSearchParams": "pagedbench.refengine.engine.beam_params",
    "BeamSearchOutput": "pagedbench.refengine.engine.beam_params",
    "BeamSearchSequence": "pagedbench.refengine.engine.beam_params",
    "RequestOutput": "pagedbench.refengine.engine.outputs",
    "CompletionOutput": "pagedbench.refengine.engine.outputs",
    "ModelConfig": "pagedbench.refengine.model.config",
    "load_model": "pagedbench.refengine.model.loader",
    "LoadedModel": "pagedbench.refengine.model.loader",
    "AttentionMetadata": "pagedbench.refengine.model.attention_backend",
    "get_attention_backend": "pagedbench.refengine.model.attention_backend",
}

#: module paths of the flat layout -> where each module lives now
MOVED_MODULES = {
    "arena": "kv.arena",
    "block_pool": "kv.block_pool",
    "free_block_queue": "kv.free_block_queue",
    "prefix_hash": "kv.prefix_hash",
    "block_manager": "kv.block_manager",
    "block_manager_checks": "kv.block_manager_checks",
    "contiguous": "kv.contiguous",
    "sequence": "engine.sequence",
    "scheduler": "engine.scheduler",
    "outputs": "engine.outputs",
    "engine_stats": "engine.stats",
    "model_config": "model.config",
    "loader": "model.loader",
    "attention_backend": "model.attention_backend",
    "sampling": "model.sampling",
}

__all__ = sorted(_EXPORTS)


install(__name__, MOVED_MODULES)


def __getattr__(name: str):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
