"""PagedBench's conformance suite: what judges a paged-attention implementation, apart from what
mutates our own code to prove the suite can fail.

- ``adapter``: the implementation-under-test interface (``Implementation``, ``register``,
  ``NotSupported``, ``Capabilities``) that every implementation, ours or another project's, fills in.
- ``registry``: every implementation by name (it imports ours and the mutation check's).
- ``implementations``, ``batched_torch_adapter``, ``flex_adapter``, ``our_launchers``: our adapters;
  ``peers/``: other projects' kernels (vLLM, SGLang).
- ``suite/``: the shipped tests, each taking an implementation.
- ``gate/``: running the suite in isolated workers, the oracle, cases and checks, outcomes, result files,
  the matrix (``python -m pagedbench.conformance``).
- ``mutation/``: the toy mutants the suite must kill, and the mutation check of the real source
  (``python -m pagedbench.conformance.mutation.check``).

The flat module paths of earlier versions (``pagedbench.conformance.checks``, ``.mutation_check``...)
still import: they are aliases of the modules' new homes.
"""

from __future__ import annotations

from pagedbench.refengine.module_aliases import install

#: module paths of the flat layout -> where each module lives now
MOVED_MODULES = {
    "worker": "gate.worker", "outcomes": "gate.outcomes", "report_files": "gate.report_files",
    "gate_environment": "gate.environment", "matrix": "gate.matrix", "matrix_markdown": "gate.matrix_markdown",
    "pytest_plugin": "gate.pytest_plugin", "cases": "gate.cases", "checks": "gate.checks",
    "oracle": "gate.oracle", "builders": "gate.builders", "validation": "gate.validation",
    "block_manager_state": "gate.block_manager_state", "harness": "gate.harness", "cascade": "gate.cascade",
    "mutation_check": "mutation.check", "mutation_operators": "mutation.operators",
    "mutation_equivalents": "mutation.equivalents", "mutation_report": "mutation.report",
    "mutation_runner": "mutation.runner", "mutants": "mutation.mutants",
}

install(__name__, MOVED_MODULES)
