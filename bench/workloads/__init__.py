"""Workloads as data, below every study: requests and the datasets' length distributions (``datasets``:
:class:`Request`, :data:`DATASETS`, :func:`synthetic`, JSONL traces), the shipped real traces' formats
(``trace_formats``), arrival processes (``arrivals``), a trace replayed over a span at a rate
(``trace_spans``), token prompts for the real engine (``token_traces``), and multi-turn sessions and
shared few-shot prefixes with token ids that share (``sessions``).

``pagedbench.bench.workloads`` was one module: its names are still here.
"""

from pagedbench.bench.workloads.datasets import (
    DATASETS,
    LengthStats,
    Request,
    json_objects,
    load_jsonl,
    save_jsonl,
    synthetic,
)

__all__ = ["DATASETS", "LengthStats", "Request", "json_objects", "load_jsonl", "save_jsonl", "synthetic"]
