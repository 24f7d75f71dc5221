"""The conformance gate: run the suite against one implementation, write a JSON summary + JUnit XML.

``python -m pagedbench.conformance --impl NAME [--load MODULE] [--out DIR] [-k EXPR] [--case TEXT] [--full]
[--jobs N] [--timeout S] [--strict-validation] [-v]`` (``make conformance IMPL=NAME``). ``--load mypkg.paged_adapter``
imports a module that registers another project's implementation (``@conformance.adapter.register``).
``--out`` defaults to a new ``conformance-results/NAME-TIME/`` folder under the working directory.

Preflight: before any case runs, one worker imports every ``--load``, builds the implementation and makes
a tensor on its device. A module that does not import or an implementation that cannot be built stops the
run with exit status 2; so does a device this machine lacks (an *environment error*: a CUDA adapter on a
CPU box), said once rather than as every case failing. Nothing is written then.

Output: a line per suite module, a line per failing case (its id, the property its test checks, and the
measured error against its bound), the counts with numerics, block accounting, validation and the
capabilities apart, and a closing list of the failing cases. ``-v`` adds the workers' pytest output.

Isolation: every suite module runs in a worker subprocess (``conformance.gate.worker``) that streams each
case's outcome to a file as it is known. When a worker dies (a signal such as SIGSEGV/SIGABRT, an exit
without its final record, or ``--timeout`` seconds of running its cases), the case it was running is
recorded as ``crashed`` and the module resumes in a fresh worker with the cases not yet reported (at most
``MAX_RESUMES`` times; then the rest are ``crashed`` too). The ``--timeout`` clock starts once a worker
has collected its cases; starting up and collecting get ``max(--timeout, MIN_COLLECT_TIMEOUT_S)``, so
a short limit does not kill workers that are still importing torch on a loaded machine. The gate itself
imports no kernel and no
Triton; ours are imported by the worker only when the implementation is ours.

Writes, atomically, ``DIR/NAME.json``::

    {"schema_version": 2, "implementation": "torch", "capabilities": {...}, "environment": {...},
     "strict_validation": false, "gate_passed": true, "counts": {"pass": 120, "fail": 0, ...},
     "counts_by_category": {"numerics": {...}, "block-manager": {...}, "validation": {...}},
     "validation": {"rejects": 12, "accepts-invalid": 0, ...},
     "cases": {"conformance/suite/test_decode.py::test_decode_matches_oracle[torch-decode/bs=16,...]":
               {"outcome": "pass", "category": "numerics", "errors": {"out_max_abs_err": 0.0009}}, ...}}

and ``DIR/NAME.junit.xml`` with the same cases. Outcomes and categories: see ``conformance.gate.outcomes``.
Exit status: non-zero when any case fails, errors or crashes — except validation findings (the
implementation accepted bad arguments, rejected them with an unexpected exception, or crashed on them),
which are reported in the ``validation`` column and fail the gate only with ``--strict-validation``; a
validation case whose rejection wrote the caller's data still fails. Non-zero too when no case passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pagedbench.conformance.gate import outcomes, report_files
from pagedbench.conformance.gate.environment import environment

SCHEMA_VERSION = 2
#: the shipped suite: every test in it takes an implementation
SUITE_DIR = Path(__file__).resolve().parent.parent / "suite"
#: what the suite needs whichever project's pytest configuration is in force where the gate runs
SUITE_PYTEST_ARGS = ("-p", "pagedbench.conformance.gate.pytest_plugin", "--import-mode=importlib")
DEFAULT_TIMEOUT_S = 3600.0
#: the least time a worker gets to start and collect its cases, whatever ``--timeout`` says
MIN_COLLECT_TIMEOUT_S = 600.0
MAX_RESUMES = 20


@dataclass(slots=True)
class ModuleRun:
    """What the workers of one suite module reported (mutable while the module runs)."""

    cases: dict[str, dict] = field(default_factory=dict)  # nodeid -> entry
    implementation: dict | None = None  # the worker's "implementation" event
    unknown: list[str] | None = None  # the known names, when the implementation was not found
    preflight: tuple[str, str] | None = None  # ("preflight_error" | "environment_error", message)


def pytest_args(*, keyword: str | None, cases: list[str], full: bool) -> list[str]:
    """The pytest options every worker runs with (the module path is added per worker)."""
    marker = "not mutants" if full else "not slow and not mutants"
    args = ["-q", "-m", marker, "-p", "no:cacheprovider", "-o", "junit_family=xunit1", *SUITE_PYTEST_ARGS]
    if keyword:
        args += ["-k", keyword]
    for text in cases:
        args += ["--case", text]
    return args


def _merge(run: ModuleRun, nodeid: str, entry: dict) -> None:
    previous = run.cases.get(nodeid)
    if previous is None or previous["outcome"] == "pass":  # a teardown error outranks a pass
        run.cases[nodeid] = entry


def _read_events(report: Path, run: ModuleRun) -> tuple[list[str] | None, bool]:
    """Fold a worker's report into ``run``; returns (the collected nodeids or None, finished?)."""
    collected, finished = None, False
    if not report.exists():
        return None, False
    for line in report.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # the last line of a worker killed mid-write
            continue
        kind = event["event"]
        if kind == "collected":
            collected = event["nodeids"]
        elif kind == "case":
            _merge(run, event["nodeid"], event["entry"])
        elif kind == "implementation":
            run.implementation = run.implementation or event
        elif kind == "unknown_implementation":
            run.unknown = event["known"]
        elif kind in ("preflight_error", "environment_error"):
            run.preflight = (kind, event["message"])
        elif kind == "finished":
            finished = True
    return collected, finished


def _death(returncode: int | None, timeout_s: float) -> str:
    if returncode is None:
        return f"timed out after {timeout_s:g} s"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode} before finishing"


def _has_collected(report: Path) -> bool:
    try:
        return '"event": "collected"' in report.read_text(encoding="utf-8")
    except OSError:
        return False


def _wait(proc: subprocess.Popen, report: Path, timeout_s: float) -> tuple[int | None, float]:
    """(the worker's exit status, or None when it was killed at its limit; that limit): ``timeout_s``
    from the moment it reported its collected cases, ``max(timeout_s, MIN_COLLECT_TIMEOUT_S)`` before."""
    start = time.monotonic()
    limit, deadline = max(timeout_s, MIN_COLLECT_TIMEOUT_S), None
    while True:
        try:
            return proc.wait(timeout=0.2), limit
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if deadline is None and _has_collected(report):
            limit, deadline = timeout_s, now + timeout_s
        if now > (deadline if deadline is not None else start + limit):
            proc.kill()
            proc.wait()
            return None, limit


def _run_worker(tmp: Path, name: str, impl: str, loads: list[str], targets: list[str], options: list[str],
                timeout_s: float, run: ModuleRun, only: list[str] | None = None, *, verbose: bool = False):
    """One worker over ``targets``; returns (collected nodeids or None, finished?, returncode or None on
    timeout, how it died as the gate words it (meaningless when it finished), the tail of its stderr).
    The worker's own pytest output (tracebacks included) is echoed only when ``verbose``."""
    report, only_file, stdout_path, stderr_path = (tmp / f"{name}.{s}" for s in ("jsonl", "only", "out", "err"))
    cmd = [sys.executable, "-m", "pagedbench.conformance.gate.worker", "--impl", impl, "--report", str(report)]
    for m in loads:
        cmd += ["--load", m]
    if only is not None:
        only_file.write_text(json.dumps(only))
        cmd += ["--only", str(only_file)]
    cmd += ["--", *targets, *options]
    with stdout_path.open("w") as out, stderr_path.open("w") as err:
        returncode, limit = _wait(subprocess.Popen(cmd, stdout=out, stderr=err), report, timeout_s)
    stderr = stderr_path.read_text(errors="replace")
    if verbose:
        sys.stdout.write(stdout_path.read_text(errors="replace"))
        sys.stderr.write(stderr[-4000:])
    collected, finished = _read_events(report, run)
    return collected, finished, returncode, _death(returncode, limit), stderr[-1500:]


def collect(impl: str, loads: list[str], options: list[str], timeout_s: float, run: ModuleRun, *,
            verbose: bool = False) -> list[str]:
    """The selected cases of the whole suite (one collect-only worker), in run order. This worker is also
    the preflight: it imports every ``--load``, builds the implementation and tries its device, so a typo
    or a missing GPU ends the run here (``run.preflight``) before any case."""
    with tempfile.TemporaryDirectory(prefix="pagedbench-gate-") as tmp:
        collected, _finished, _returncode, death, tail = _run_worker(
            Path(tmp), "collect", impl, loads, [str(SUITE_DIR)], [*options, "--collect-only"], timeout_s, run,
            verbose=verbose)
    if run.unknown is None and run.preflight is None and collected is None:
        run.cases[str(SUITE_DIR)] = {"outcome": "crashed", "category": "numerics",
                                     "message": f"worker {death} while collecting\n{tail}"}
    return collected or []


def run_module(module: Path, impl: str, loads: list[str], options: list[str], timeout_s: float,
               run: ModuleRun, *, verbose: bool = False) -> None:
    """Run one suite module in workers until every selected case has an outcome."""
    only: list[str] | None = None
    category = outcomes.MODULE_CATEGORY.get(module.name, "numerics")
    with tempfile.TemporaryDirectory(prefix="pagedbench-gate-") as tmp:
        for attempt in range(MAX_RESUMES + 1):
            collected, finished, returncode, death, tail = _run_worker(
                Path(tmp), str(attempt), impl, loads, [str(module)], options, timeout_s, run, only, verbose=verbose)
            if run.unknown is not None or (finished and returncode is not None and returncode >= 0):
                return
            if collected is None:  # died before its cases were known: the module stands for them
                run.cases[str(module)] = {"outcome": "crashed", "category": category,
                                          "message": f"worker {death} before collecting {module.name}\n{tail}"}
                return
            pending = [n for n in collected if n not in run.cases]
            if not pending:
                return
            culprit, only = pending[0], pending[1:]
            run.cases[culprit] = {"outcome": "crashed", "category": run.cases.get(culprit, {}).get(
                "category", category), "message": f"worker {death} while this case ran\n{tail}"}
            if not only:
                return
        for nodeid in only or ():
            run.cases[nodeid] = {"outcome": "crashed", "category": category,
                                 "message": f"not run: the module crashed more than {MAX_RESUMES} times"}


def summarize(impl: str, run: ModuleRun, *, strict_validation: bool, options: list[str]) -> dict:
    cases = run.cases
    for entry in cases.values():
        if entry.get("category") == "validation":
            verdict = outcomes.validation_verdict(entry["outcome"])
            if verdict is not None:
                entry["validation"] = verdict
    counts = {k: 0 for k in outcomes.OUTCOMES}
    by_category = {c: {k: 0 for k in outcomes.OUTCOMES} for c in outcomes.CATEGORIES}
    verdicts = {v: 0 for v in outcomes.VALIDATION_VERDICTS}
    for entry in cases.values():
        counts[entry["outcome"]] += 1
        by_category.setdefault(entry.get("category", "numerics"), {k: 0 for k in outcomes.OUTCOMES})
        by_category[entry.get("category", "numerics")][entry["outcome"]] += 1
        if "validation" in entry:
            verdicts[entry["validation"]] += 1
    failing = sorted(n for n, e in cases.items() if outcomes.fails_gate(e, strict_validation=strict_validation))
    info = run.implementation or {}
    return {"schema_version": SCHEMA_VERSION, "implementation": impl,
            "capabilities": info.get("capabilities"), "environment": environment(info),
            "pytest_args": options, "strict_validation": strict_validation,
            "gate_passed": not failing and counts["pass"] > 0, "failing_cases": failing,
            "counts": counts, "counts_by_category": by_category, "validation": verdicts, "cases": cases}


def default_out(impl: str, now: float | None = None) -> Path:
    """A fresh folder per run under the working directory: a run never overwrites the published
    ``results/conformance`` unless asked to with ``--out`` (the Makefile's targets ask)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path("conformance-results") / f"{impl}-{stamp}"


def failing_line(nodeid: str, entry: dict) -> str:
    """One line for a failing case: outcome, case id, the property its test checks, and what was
    measured against its bound (the first line of the check's message)."""
    path, _, name = nodeid.partition("::")
    test, _, case = name.partition("[")
    prop = test.removeprefix("test_") or Path(path).stem
    detail = (entry.get("message") or "").strip().splitlines()
    detail = detail[0] if detail else ""
    for prefix in ("AssertionError: ", "Failed: "):
        detail = detail.removeprefix(prefix)
    context, sep, rest = detail.partition(": ")
    if sep and context in case:  # the checks start their messages with the case id, already shown
        detail = rest
    if len(detail) > 200:
        detail = detail[:197] + "..."
    return f"  {entry['outcome'].upper():<8} {Path(path).name}::{name}\n           {prop}: {detail or '(no message)'}"


def headline(impl: str, summary: dict) -> str:
    """The run's counts with numerics, block accounting, validation and capabilities apart, so a pass
    count never mixes argument checks with results."""
    parts = []
    for category in ("numerics", "block-manager"):
        counts = summary["counts_by_category"].get(category, {})
        shown = ", ".join(f"{v} {k}" for k, v in counts.items() if v and k != "not supported")
        if shown:
            parts.append(f"{category} {shown}")
    verdicts = ", ".join(f"{v} {k}" for k, v in summary["validation"].items() if v)
    if verdicts:
        parts.append(f"validation {verdicts}")
    unsupported = summary["counts"]["not supported"]
    if unsupported:
        parts.append(f"{unsupported} not supported (declared capabilities)")
    return f"conformance gate [{impl}]: " + ("; ".join(parts) or "no case")


def _nothing_passed_reason(summary: dict) -> str:
    counts = summary["counts"]
    if not summary["cases"]:
        return "no case selected (check -k and --case)"
    if counts["not supported"] + counts["skipped"] == len(summary["cases"]):
        return "every selected case is outside what the implementation supports"
    return "no selected case passed"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from pagedbench.conformance import registry

    parser = argparse.ArgumentParser(
        prog="python -m pagedbench.conformance", description=__doc__.split("\n")[0],
        epilog="implementations: " + ", ".join(registry.listed())
        + " (another project's: --load the module that registers it). Exit status: 0 passed, 1 failed, "
          "2 could not run (bad arguments, a --load that does not import, a device this machine lacks).")
    parser.add_argument("--impl", required=True, help="the registered implementation to check")
    parser.add_argument("--load", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (it registers implementations); repeatable")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: a new conformance-results/IMPL-TIME/ here)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression selecting tests")
    parser.add_argument("--case", action="append", default=[],
                        help="only tests whose id contains this text, e.g. 'bs=16,ctx=97' (repeatable)")
    parser.add_argument("--full", action="store_true", help="include the `slow` full grids")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds a suite module's worker may run its cases before it is killed "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--jobs", type=_positive_int, default=1,
                        help="suite modules run at once, each in its own worker (default 1; on a GPU box, "
                             "where compiling the kernels' variants dominates, about the CPU count)")
    parser.add_argument("--strict-validation", action="store_true",
                        help="fail the gate on validation findings too (accepts invalid input, ...)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also print the workers' pytest output (tracebacks) and full messages")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    options = pytest_args(keyword=args.keyword, cases=args.case, full=args.full)
    run = ModuleRun()
    selected = collect(args.impl, args.load, options, args.timeout, run, verbose=args.verbose)
    if run.unknown is not None:
        parser.error(f"unknown implementation {args.impl!r}; known: {', '.join(run.unknown)}")
    if run.preflight is not None:
        kind, message = run.preflight
        what = "environment error" if kind == "environment_error" else "cannot start"
        print(f"conformance gate [{args.impl}]: {what}: {message}; nothing was run or written", file=sys.stderr)
        return 2
    # one worker per module that has selected cases; --jobs of them at once, reported in the suite's order
    names = list(dict.fromkeys(Path(n.partition("::")[0]).name for n in selected if "::" in n))

    def one(name: str) -> ModuleRun:
        module_run = ModuleRun()
        run_module(SUITE_DIR / name, args.impl, args.load, options, args.timeout, module_run, verbose=args.verbose)
        return module_run

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for name, module_run in zip(names, pool.map(one, names)):
            run.cases.update(module_run.cases)
            run.implementation = run.implementation or module_run.implementation
            _print_module(name, module_run.cases, args)
    summary = summarize(args.impl, run, strict_validation=args.strict_validation, options=options)
    out = args.out if args.out is not None else default_out(args.impl)
    json_path, junit_path = out / f"{args.impl}.json", out / f"{args.impl}.junit.xml"
    report_files.write_json(json_path, summary)
    report_files.write_atomically(
        junit_path, report_files.junit_xml(args.impl, run.cases, failing=set(summary["failing_cases"])))
    print(headline(args.impl, summary))
    findings = {k: v for k, v in summary["validation"].items() if v and k in outcomes.VALIDATION_FINDINGS}
    if findings and not args.strict_validation:
        print(f"conformance gate [{args.impl}]: validation findings are reported, not failing "
              "(--strict-validation fails on them)")
    if summary["failing_cases"]:
        print(f"failing cases ({len(summary['failing_cases'])}):")
        for nodeid in summary["failing_cases"]:
            print(f"  {nodeid}")
    print(f"wrote {junit_path} and {json_path}")
    if summary["counts"]["pass"] == 0:
        # A gate that checked nothing must not look green (a typo in -k/--case, or nothing supported).
        print(f"conformance gate [{args.impl}]: FAILED: {_nothing_passed_reason(summary)}")
        return 1
    print(f"conformance gate [{args.impl}]: {'PASSED' if summary['gate_passed'] else 'FAILED'}")
    return 0 if summary["gate_passed"] else 1


def _print_module(name: str, cases: dict[str, dict], args: argparse.Namespace) -> None:
    """One line for a suite module, then one per failing case (full messages with -v)."""
    tally: dict[str, int] = {}
    for entry in cases.values():
        tally[entry["outcome"]] = tally.get(entry["outcome"], 0) + 1
    print(f"{name}: " + (", ".join(f"{v} {k}" for k, v in tally.items()) or "no case"), flush=True)
    for nodeid, entry in cases.items():
        if outcomes.fails_gate(entry, strict_validation=args.strict_validation):
            print(failing_line(nodeid, entry))
            if args.verbose and entry.get("message"):
                print("           " + entry["message"].replace("\n", "\n           "))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    sys.exit(main())
