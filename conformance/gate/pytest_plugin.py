"""Pytest wiring for the conformance suite: which implementations run, and how "not supported" shows.

``--impl NAME[,NAME...]`` picks the implementations (default: every built-in one that is expected to
pass: triton and torch). A test that takes the ``impl`` fixture runs once per implementation, with the
implementation's name in its id; an operation the implementation does not support is reported as a
skip that says so.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from pagedbench.conformance import adapter, registry


def _claim_the_kernels_name() -> None:
    """Import Hugging Face's ``kernels`` distribution, when installed, before collection starts.

    Collecting this repository imports its ``kernels/__init__.py`` under the bare name ``kernels`` (the
    folder is a package at the root of the tree), which would then stand in for that distribution in
    ``sys.modules`` and break transformers, which imports it. Taken first, the name stays theirs, and
    ours is always imported as ``pagedbench.kernels``.
    """
    ours = Path(__file__).resolve().parents[2] / "kernels"
    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin and Path(spec.origin).resolve().parent != ours:
        importlib.import_module("kernels")


_claim_the_kernels_name()

BUILTIN_IMPLS = ("triton", "torch", "flex")
#: what runs without --impl: the built-ins expected to pass (flex is known to fail, see
#: conformance/flex_adapter.py; check it with `python -m pagedbench.conformance --impl flex`)
DEFAULT_IMPLS = tuple(n for n in BUILTIN_IMPLS if registry.expected_to_pass(n))

settings.register_profile("dev", deadline=None, max_examples=100)
settings.register_profile(
    "ci", deadline=None, max_examples=100, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "validation: checks that the implementation rejects bad arguments (the gate reports "
                   "these in a validation column of their own)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--impl", action="store", default=",".join(DEFAULT_IMPLS),
        help=f"comma-separated implementations to check (known: {', '.join(registry.available())})",
    )
    parser.addoption(
        "--case", action="append", default=[],
        help="run only tests whose id contains this text, e.g. 'bs=16,ctx=97' (repeatable: any of them)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # --case TEXT: keep the tests whose id contains TEXT (case ids hold "=" and ",", which -k cannot).
    wanted = config.getoption("--case")
    if not wanted:
        return
    keep = [i for i in items if any(w in i.nodeid for w in wanted)]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


def selected_impls(config: pytest.Config) -> list[str]:
    names = [n.strip() for n in config.getoption("--impl").split(",") if n.strip()]
    known = registry.available()
    for n in names:
        if n not in known:
            raise pytest.UsageError(f"--impl: unknown implementation {n!r}; known: {', '.join(known)}")
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" in metafunc.fixturenames:
        names = selected_impls(metafunc.config)
        metafunc.parametrize("impl", names, indirect=True, ids=names, scope="session")


@pytest.fixture(scope="session")
def impl(request: pytest.FixtureRequest) -> adapter.Implementation:
    return registry.get(request.param)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    try:
        return (yield)
    except adapter.NotSupported as e:
        pytest.skip(f"not supported: {e}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # The errors a test's comparisons measured (conformance.gate.checks.record) go into its report: the
    # JUnit XML shows them as properties and the gate's JSON summary reads them from there; so do the
    # properties left unchecked for want of a capability.
    from pagedbench.conformance import capabilities
    from pagedbench.conformance.gate import checks, outcomes

    if call.when == "call":
        for name, value in sorted(checks.take_recorded(item.nodeid).items()):
            item.user_properties.append((name, value))
        unchecked = capabilities.take_unchecked(item.nodeid)
        if unchecked:
            item.user_properties.append(("not_supported", ",".join(unchecked)))
    report = yield
    # What the gate classifies by: the part of the contract the test checks, and what was raised.
    report.conformance_category = outcomes.category_of(item)
    report.conformance_failure = outcomes.failure_kind(call.excinfo)
    return report


def _kill_rows() -> list[tuple]:
    """This process's rows of the mutation check's kill table, when test_mutants ran here."""
    import sys

    modules = [m for name, m in list(sys.modules.items()) if name.rpartition(".")[2] == "test_mutants"]
    rows = next((m.KILL_TABLE for m in modules if getattr(m, "KILL_TABLE", None)), None) or []
    return [(r.mutant, r.killed, r.first_failure, r.seconds) for r in rows]


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Under pytest-xdist the mutants run in worker processes: each hands its rows to the controller,
    # which prints one table (pytest_testnodedown collects them).
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["pagedbench_kill_rows"] = _kill_rows()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    rows = getattr(node, "workeroutput", {}).get("pagedbench_kill_rows", [])
    node.config.stash.setdefault(_WORKER_KILL_ROWS, []).extend(tuple(r) for r in rows)


_WORKER_KILL_ROWS = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    # The mutation check's kill table, when test_mutants ran (here or in xdist workers).
    rows = sorted(_kill_rows() + config.stash.get(_WORKER_KILL_ROWS, []))
    if not rows:
        return
    from tabulate import tabulate

    killed = sum(bool(r[1]) for r in rows)
    terminalreporter.write_sep("=", f"mutation check: {killed} of {len(rows)} mutants killed")
    table = [(mutant, "killed" if ok else "SURVIVED", first or "-", f"{seconds:.1f}")
             for mutant, ok, first, seconds in rows]
    terminalreporter.write_line(tabulate(table, headers=("mutant", "verdict", "first failing test", "s")))


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request: pytest.FixtureRequest):
    # A fixture that builds something from the implementation (e.g. ``impl.block_manager(...)``) and
    # meets an unsupported operation: "not supported", like a test body that does.
    try:
        return (yield)
    except adapter.NotSupported as e:
        pytest.skip(f"not supported: {e}")
