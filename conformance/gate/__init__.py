"""The gate: the suite run against one implementation in isolated workers, judged against a float64
oracle, written as a JSON summary and JUnit XML (``python -m pagedbench.conformance``; see ``runner``).

``pagedbench.conformance.gate.main`` is the command line, as it was when the gate was one module.
"""

from pagedbench.conformance.gate.runner import default_out, failing_line, headline, main, summarize

__all__ = ["default_out", "failing_line", "headline", "main", "summarize"]
