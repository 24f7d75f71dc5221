"""The incremental detokenizer lives with the engine (stop strings need it there); this path still imports."""

from pagedbench.refengine.engine.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
