"""The conformance gate: run the suite against one implementation, write JUnit XML + a JSON summary.

``python -m pagedbench.conformance --impl NAME [--load MODULE] [--out DIR] [-k EXPR] [--case TEXT] [--full]``
(``make conformance IMPL=NAME``). ``--load mypkg.paged_adapter`` imports a module that registers another
project's implementation (``@conformance.adapter.register("mine")``) before the suite runs.
Writes ``DIR/NAME.junit.xml`` (pytest's ``--junitxml``; measured errors appear as test properties) and
``DIR/NAME.json``::

    {"schema_version": 1, "implementation": "torch", "environment": {...}, "pytest_args": [...],
     "counts": {"pass": 120, "fail": 0, "not supported": 3, "skipped": 0, "error": 0},
     "cases": {"conformance/suite/test_decode.py::test_decode_matches_oracle[torch-decode/bs=16,...]":
               {"outcome": "pass", "errors": {"out_max_abs_err": 0.0009, "out_rel_err": 0.0002}}, ...}}

Outcomes: ``pass``; ``fail`` (an assertion: wrong result); ``error`` (the implementation or a fixture
raised something other than an assertion — also counted as a failure by the exit status); ``not
supported`` (the implementation raised ``NotSupported`` or does not claim the dtype); ``skipped`` (any
other skip, e.g. a test that needs a GPU). The exit status is non-zero on any fail or error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest
from pagedbench.bench import records

SCHEMA_VERSION = 1
DEFAULT_OUT = Path("results/conformance")
#: the shipped suite: every test in it takes an implementation
SUITE_DIR = Path(__file__).resolve().parent / "suite"
#: what the suite needs whichever project's pytest configuration is in force where the gate runs
SUITE_PYTEST_ARGS = ("-p", "pagedbench.conformance.pytest_plugin", "--import-mode=importlib")


class _Collector:
    """A pytest plugin keeping the outcome of every test, keyed by nodeid."""

    def __init__(self) -> None:
        self.cases: dict[str, dict] = {}

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        # Only tests that take an implementation belong to the gate (not our engine's own tests).
        chosen = [i for i in items if "impl" in getattr(i, "fixturenames", ())]
        dropped = [i for i in items if "impl" not in getattr(i, "fixturenames", ())]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = chosen

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            entry = {"outcome": _outcome(report)}
            if report.outcome != "passed":
                entry["message"] = _message(report)
            errors = {k: v for k, v in report.user_properties if k.endswith("_err") or k.endswith("_mib")}
            if errors:
                entry["errors"] = errors
            previous = self.cases.get(report.nodeid)
            if previous is None or previous["outcome"] == "pass":  # a teardown error outranks a pass
                self.cases[report.nodeid] = entry


def _outcome(report: pytest.TestReport) -> str:
    if report.passed:
        return "pass"
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return "not supported" if "not supported" in reason else "skipped"
    if report.when != "call":
        return "error"
    crash = getattr(report.longrepr, "reprcrash", None)
    return "fail" if crash is not None and crash.message.startswith("AssertionError") else "error"


def _message(report: pytest.TestReport) -> str:
    if isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    return (crash.message if crash is not None else str(report.longrepr))[:2000]


def pytest_args(impl: str, junit: Path, *, keyword: str | None, cases: list[str], full: bool) -> list[str]:
    """The pytest command line the gate runs (the whole conformance suite but the mutation check)."""
    marker = "not mutants" if full else "not slow and not mutants"
    args = [str(SUITE_DIR), "-q", "--impl", impl, "-m", marker, f"--junitxml={junit}",
            "-p", "no:cacheprovider", "-o", "junit_family=xunit1", *SUITE_PYTEST_ARGS]
    if keyword:
        args += ["-k", keyword]
    for text in cases:
        args += ["--case", text]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.conformance", description=__doc__.split("\n")[0])
    parser.add_argument("--impl", required=True, help="the registered implementation to check")
    parser.add_argument("--load", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (it registers implementations); repeatable")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression selecting tests")
    parser.add_argument("--case", action="append", default=[],
                        help="only tests whose id contains this text, e.g. 'bs=16,ctx=97' (repeatable)")
    parser.add_argument("--full", action="store_true", help="include the `slow` full grids")
    args = parser.parse_args(argv)
    from pagedbench.conformance import adapter

    for module in args.load:
        importlib.import_module(module)
    if args.impl not in adapter.available():
        parser.error(f"unknown implementation {args.impl!r}; known: {', '.join(adapter.available())}")
    args.out.mkdir(parents=True, exist_ok=True)
    junit = args.out / f"{args.impl}.junit.xml"
    collector = _Collector()
    cmd = pytest_args(args.impl, junit, keyword=args.keyword, cases=args.case, full=args.full)
    status = pytest.main(cmd, plugins=[collector])
    summary = write_summary(args.out / f"{args.impl}.json", args.impl, cmd, collector.cases)
    counts = summary["counts"]
    print(f"conformance gate [{args.impl}]: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    print(f"wrote {junit} and {args.out / (args.impl + '.json')}")
    failed = counts["fail"] + counts["error"]
    if counts["pass"] == 0:
        # A gate that checked nothing must not look green (a typo in -k/--case, or nothing supported).
        print(f"conformance gate [{args.impl}]: no test passed (none selected, or none supported): failing")
        return 1
    if failed or status != pytest.ExitCode.OK:
        return 1
    return 0


def write_summary(path: Path, impl: str, cmd: list[str], cases: dict[str, dict]) -> dict:
    from pagedbench.bench.environment import environment

    counts = {k: 0 for k in ("pass", "fail", "not supported", "skipped", "error")}
    for entry in cases.values():
        counts[entry["outcome"]] += 1
    summary = {"schema_version": SCHEMA_VERSION, "implementation": impl, "environment": environment(),
               "pytest_args": cmd, "counts": counts, "cases": cases}
    records.write_json(path, summary)
    return summary


if __name__ == "__main__":
    sys.exit(main())
