"""Runs mutants of real source files, each in a copy of the tree, and classifies what the tests did.

A :class:`Workspace` is a temporary folder holding ``pagedbench/<package>`` copies of the project's
package folders (and its ``pyproject.toml``, for pytest's options); it goes first on ``PYTHONPATH``, so
``import pagedbench.kernels`` in the test process finds the copy, never the working tree (the editable
install's finder comes after the path). One mutant at a time is written into a workspace and the copy
restored after its run; the working tree is never written.

The tests run as ``pytest -x -v``, one subprocess per test file (each in its own session, killed whole
at the timeout), until one does not pass.
:func:`classify` reads the outcome:

* ``killed``  -- a test failed on an ``AssertionError`` (a check saw a wrong value);
* ``error``   -- a test failed on another exception, or the tests could not be collected (the mutant
  broke an import, a kernel's compilation, a launcher's call ...): killed, but not by a check;
* ``crashed`` -- the process died on a signal (SIGSEGV from an out-of-range address, SIGABRT ...);
* ``timeout`` -- the tests ran past the limit (a hang counts as a kill, reported as such);
* ``survived`` -- every test passed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: the repository folders the copy holds, under the package name they install as
PACKAGES = ("kernels", "refengine", "conformance", "bench")
OUTCOMES = ("killed", "error", "crashed", "timeout", "survived")
KILLED = ("killed", "error", "crashed", "timeout")


@dataclass(frozen=True, slots=True)
class RunResult:
    """What one test run of one mutant (or of the unmutated copy) showed."""

    outcome: str  # one of OUTCOMES
    test: str  # the test that failed, crashed or hung ("" when none is known)
    detail: str  # the exception line, the signal, or the limit
    seconds: float
    returncode: int | None  # None: killed at the timeout


class Workspace:
    """A private copy of the package folders that one mutant at a time is written into."""

    def __init__(self, repo_root: Path, parent: Path | None = None, packages: tuple[str, ...] = PACKAGES) -> None:
        self.repo_root = Path(repo_root)
        self.root = Path(tempfile.mkdtemp(prefix="pagedbench-mutants-", dir=parent))
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
        for pkg in packages:
            if (self.repo_root / pkg).is_dir():
                shutil.copytree(self.repo_root / pkg, self.root / "pagedbench" / pkg, ignore=ignore)
        if (self.repo_root / "pyproject.toml").exists():
            shutil.copy2(self.repo_root / "pyproject.toml", self.root / "pyproject.toml")

    def copy_of(self, path: str) -> Path:
        """The workspace's copy of a repository path such as ``kernels/attention_kernels.py``."""
        return self.root / "pagedbench" / path

    def write(self, path: str, source: str) -> None:
        target = self.copy_of(path)
        target.write_text(source, encoding="utf-8")
        shutil.rmtree(target.parent / "__pycache__", ignore_errors=True)  # never run a stale bytecode file

    def restore(self, path: str) -> None:
        self.write(path, (self.repo_root / path).read_text(encoding="utf-8"))

    def env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH")
        return {
            **os.environ,
            "PYTHONPATH": str(self.root) + (os.pathsep + path if path else ""),
            "PYTHONDONTWRITEBYTECODE": "1",
            "COLUMNS": "400",  # the short summary keeps its message
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        }

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def pytest_command(tests: tuple[str, ...], extra: tuple[str, ...] = ()) -> list[str]:
    """``tests`` are repository paths (``conformance/suite/test_decode.py``, optionally ``::name``)."""
    return [
        sys.executable,
        "-m",
        "pytest",
        *(f"pagedbench/{t}" for t in tests),
        "-x",
        "-v",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "-o",
        "console_output_style=classic",
        "-m",
        "not slow and not gpu and not model",
        "--timeout",
        "0",
        *extra,
    ]


def run_tests(workspace: Workspace, tests: tuple[str, ...], timeout_s: float, extra: tuple[str, ...] = ()) -> RunResult:
    """The tests against the workspace as it stands, one pytest process per test file in the given order
    (collecting a large module costs more than a fast module's run: a mutant the first file kills never
    pays for the others), stopping at the first that does not pass. The limit covers them all; the whole
    process group is killed when it runs out."""
    start = time.perf_counter()
    result = RunResult("survived", "", "", 0.0, 0)
    for test in tests:
        left = timeout_s - (time.perf_counter() - start)
        result = _run_pytest(workspace, test, left, timeout_s, extra)
        if result.outcome != "survived":
            break
    return RunResult(result.outcome, result.test, result.detail, time.perf_counter() - start, result.returncode)


def _run_pytest(workspace: Workspace, test: str, left_s: float, timeout_s: float, extra: tuple[str, ...]) -> RunResult:
    start = time.perf_counter()
    proc = subprocess.Popen(
        pytest_command((test,), extra),
        cwd=workspace.root,
        env=workspace.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=max(left_s, 1.0))
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        returncode = None
    return classify(returncode, output, time.perf_counter() - start, timeout_s)


_RESULT = re.compile(r"^(\S+::\S+(?:\[.*\])?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
_STARTED = re.compile(r"^(\S+::\S+(?:\[.*?\])?) ")
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+?)(?: - (.*))?$")


def _strip(nodeid: str) -> str:
    return nodeid.removeprefix("pagedbench/")


def classify(returncode: int | None, output: str, seconds: float, timeout_s: float) -> RunResult:
    """The outcome of one ``pytest -x -v`` run from its exit status and output (see the module docstring)."""
    lines = output.splitlines()
    last_started = ""
    for line in lines:  # -v prints a test's id before it runs and its result after: a crash leaves no result
        started = _STARTED.match(line)
        if started and "::" in started.group(1):
            last_started = _strip(started.group(1))
    if returncode is None:
        return RunResult("timeout", last_started, f"no result after {timeout_s:g} s", seconds, None)
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return RunResult("crashed", last_started, f"killed by {name}", seconds, returncode)
    if returncode == 0:
        return RunResult("survived", "", "", seconds, 0)
    for line in lines:
        m = _SUMMARY.match(line)
        if m:
            test, message = _strip(m.group(2)), (m.group(3) or "").strip()
            kind = "killed" if m.group(1) == "FAILED" and _asserted(output, message) else "error"
            return RunResult(kind, test, message[:300], seconds, returncode)
    tail = " | ".join(line for line in lines[-5:] if line.strip())
    return RunResult("error", last_started, f"exit status {returncode}: {tail[-300:]}", seconds, returncode)


def _asserted(output: str, message: str) -> bool:
    """Whether the failure was an assertion: pytest's short summary names the exception type, and an
    ``assert`` statement's failure (``assert x == y``) reads ``AssertionError`` or ``assert ...``."""
    return message.startswith(("AssertionError", "assert ", "Failed:")) or (not message and "AssertionError" in output)
