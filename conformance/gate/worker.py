"""One gate worker: run part of the suite in this process and stream each case's outcome to a file.

``python -m pagedbench.conformance.gate.worker --impl NAME [--load MODULE] --report FILE [--only FILE]
-- PYTEST_ARGS`` (the gate starts one per suite module, see ``conformance.gate.runner``). The report is JSON
lines, each flushed as soon as it is known, so whatever this process manages to say before it dies
(a segfault, ``os.abort()``, a timeout) reaches the gate::

    {"event": "preflight_error" | "environment_error", "message": ...}   (and nothing more)
    {"event": "implementation", "name": ..., "capabilities": {...}, "describe": {...}}
    {"event": "collected", "nodeids": [...]}              (the selected cases, in run order)
    {"event": "case", "nodeid": ..., "entry": {...}}      (per failing phase, and per call)
    {"event": "finished", "exitstatus": 0}

An *environment error* is a device this machine lacks, or an implementation whose constructor raises
``NotSupported`` (an outside kernel saying "needs CUDA"): the implementation may be fine elsewhere.

``--only FILE`` (a JSON list of nodeids) keeps just those cases: the gate resumes a module after a crash
with the cases not yet reported. Nothing here imports kernels: the implementation does, if it wants them.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import sys
from pathlib import Path

import pytest


class Reporter:
    """A pytest plugin keeping only the tests that take an implementation, and writing report events."""

    def __init__(self, report: Path, only: set[str] | None) -> None:
        self._file = report.open("a", encoding="utf-8")
        self._only = only

    def event(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        # Only tests that take an implementation belong to the gate (not our launchers' own checks).
        chosen = [i for i in items if "impl" in getattr(i, "fixturenames", ())
                  and (self._only is None or i.nodeid in self._only)]
        dropped = [i for i in items if i not in chosen]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = chosen

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.event({"event": "collected", "nodeids": [i.nodeid for i in session.items]})

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:  # a module that does not even import: its id stands for its cases
            self.event({"event": "case", "nodeid": report.nodeid,
                        "entry": {"outcome": "error", "category": "numerics", "when": "collect",
                                  "message": str(report.longrepr)[-2000:]}})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and report.outcome == "passed":
            return
        from pagedbench.conformance.gate import outcomes

        category = getattr(report, "conformance_category", "numerics")
        entry = {"outcome": outcomes.outcome_of(report, category, getattr(report, "conformance_failure", None)),
                 "category": category, "when": report.when, "seconds": round(report.duration, 4)}
        if report.outcome != "passed":
            entry["message"] = _message(report)
        props = dict(report.user_properties)
        errors = {k: v for k, v in props.items() if k.endswith("_err") or k.endswith("_mib")}
        if errors:
            entry["errors"] = errors
        if "not_supported" in props:
            entry["not_supported"] = props["not_supported"].split(",")
        self.event({"event": "case", "nodeid": report.nodeid, "entry": entry})


def _message(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    return (crash.message if crash is not None else str(report.longrepr))[:2000]


#: the worker's exit status when it stopped before running any case (see the preflight events)
PREFLIGHT_STATUS = 2


def device_problem(device) -> str | None:
    """Why tensors cannot be made on ``device`` here (None: they can). An adapter built for CUDA on a
    machine without one is an environment error, not a failure of every case."""
    import torch

    try:
        torch.empty(1, device=device)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def _no_core_dumps() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.conformance.gate.worker")
    parser.add_argument("--impl", required=True)
    parser.add_argument("--load", action="append", default=[])
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--only", type=Path)
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    _no_core_dumps()
    faulthandler.enable()  # a segfault prints every thread's stack to stderr (the gate keeps its tail)
    only = set(json.loads(args.only.read_text())) if args.only else None
    reporter = Reporter(args.report, only)
    from pagedbench.conformance import registry
    from pagedbench.conformance.adapter import NotSupported

    for module in args.load:
        try:
            importlib.import_module(module)
        except Exception as e:  # a typo or a broken adapter module: said once, before any case runs
            reporter.event({"event": "preflight_error",
                            "message": f"--load {module}: cannot import it: {type(e).__name__}: {e}"})
            return PREFLIGHT_STATUS
    if args.impl not in registry.available():
        reporter.event({"event": "unknown_implementation", "known": registry.listed()})
        return 4
    try:
        impl = registry.get(args.impl)
    except NotSupported as e:  # an outside implementation that says it cannot run on this machine
        reporter.event({"event": "environment_error", "message": f"{args.impl!r}: not supported: {e}"})
        return PREFLIGHT_STATUS
    except Exception as e:
        reporter.event({"event": "preflight_error",
                        "message": f"cannot construct {args.impl!r}: {type(e).__name__}: {e}"})
        return PREFLIGHT_STATUS
    problem = device_problem(impl.device)
    if problem is not None:
        reporter.event({"event": "environment_error", "message": f"{args.impl!r} runs on {impl.device}, "
                        f"which this machine does not have ({problem})"})
        return PREFLIGHT_STATUS
    reporter.event({"event": "implementation", "name": args.impl,
                    "capabilities": impl.capabilities.as_record(), "describe": impl.describe()})
    pytest_args = [a for a in args.pytest_args if a != "--"] + ["--impl", args.impl]
    status = pytest.main(pytest_args, plugins=[reporter])
    reporter.event({"event": "finished", "exitstatus": int(status)})
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
