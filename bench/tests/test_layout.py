"""The harness's layout, read from the source with ``ast``: imports point one way.

- The core (``common/``, ``workloads/``, ``sim/``, ``costmodel/``) imports no study and no command.
- A study (``studies/<study>/``) imports the core, never another study.
- ``kernels/`` imports nothing from ``refengine``, ``bench`` or ``conformance``.

An old flat path (``pagedbench.bench.serving_study``) counts as the module it is an alias of, so an import
cannot slip past the rule under its old name. And ``bench/`` stays a house of folders: few modules at its
top, none over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pagedbench.bench import MOVED_MODULES

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
CORE = ("common", "workloads", "sim", "costmodel")


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports (``package``: the file's own package, for relative imports), with
    ``from pkg import name`` read as ``pkg.name`` too (it may be a submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def bench_target(module: str, moved: dict[str, str]) -> str | None:
    """``module`` as a path inside ``pagedbench.bench`` (an old path resolved to its new home), or None."""
    prefix = "pagedbench.bench."
    if not module.startswith(prefix):
        return None
    rest = module[len(prefix):]
    head, _, tail = rest.partition(".")
    if head in moved:
        rest = moved[head] + (f".{tail}" if tail else "")
    return rest


def layout_violations(bench: Path, moved: dict[str, str]) -> list[str]:
    """Each import in ``bench`` (a tree laid out as ``pagedbench.bench``) that breaks the rules above, once
    per file and study (or command) it reaches."""
    problems = set()
    for path in sorted(bench.rglob("*.py")):
        rel = path.relative_to(bench)
        if rel.parts[0] in ("tests", "micro") or len(rel.parts) < 2:
            continue
        package = ".".join(("pagedbench", "bench", *rel.parts[:-1]))
        for module in imported_modules(path, package):
            target = bench_target(module, moved)
            if not target:
                continue
            parts = target.split(".")
            if rel.parts[0] in CORE:
                if parts[0] == "studies":
                    problems.add(f"{rel} (core) imports {'.'.join(parts[:2])}")
                elif parts[0] not in CORE and parts[0] != "module_aliases" and (bench / f"{parts[0]}.py").is_file():
                    problems.add(f"{rel} (core) imports the command {parts[0]}")
            elif (rel.parts[0] == "studies" and len(rel.parts) > 2 and parts[0] == "studies" and len(parts) > 1
                  and parts[1] != rel.parts[1]):
                problems.add(f"{rel} (study {rel.parts[1]}) imports study {parts[1]}")
    return sorted(problems)


def kernel_violations(kernels: Path) -> list[str]:
    """Each file of ``kernels`` that imports refengine, bench or conformance, with what it imports."""
    problems = set()
    for path in sorted(kernels.rglob("*.py")):
        if "tests" in path.relative_to(kernels).parts:
            continue
        for module in imported_modules(path, "pagedbench.kernels"):
            top = module.split(".")[:2]
            if top in (["pagedbench", "refengine"], ["pagedbench", "bench"], ["pagedbench", "conformance"]):
                problems.add(f"kernels/{path.relative_to(kernels)} imports {'.'.join(top)}")
    return sorted(problems)


def test_core_imports_no_study_and_no_study_imports_another():
    assert layout_violations(BENCH, MOVED_MODULES) == []


def test_kernels_import_nothing_above_them():
    assert kernel_violations(ROOT / "kernels") == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "bench" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "bench"


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("sim/x.py", "from pagedbench.bench.studies.serving import report\n", "sim/x.py (core) imports"),
    ("common/x.py", "import pagedbench.bench.studies.beam.study\n", "common/x.py (core) imports"),
    # an old flat path is the module it aliases
    ("workloads/x.py", "from pagedbench.bench import serving_study\n", "workloads/x.py (core) imports"),
    ("sim/x.py", "from pagedbench.bench.loadgen import main\n", "sim/x.py (core) imports"),
    ("studies/a/x.py", "from pagedbench.bench.studies.b import study\n", "(study a) imports study b"),
    ("studies/a/x.py", "from pagedbench.bench import serving_study\n", "imports study serving"),
    ("studies/a/x.py", "from ..b.study import main\n", "imports study b"),
])
def test_a_planted_import_against_the_direction_is_named(tmp_path, name, text, expected):
    bench = _tree(tmp_path, {name: text, "loadgen.py": ""})
    problems = layout_violations(bench, {"serving_study": "studies.serving.study"})
    assert len(problems) == 1 and expected in problems[0], problems


def test_allowed_imports_are_not_flagged(tmp_path):
    bench = _tree(tmp_path, {
        "studies/a/x.py": "from pagedbench.bench.studies.a import report\nfrom pagedbench.bench.sim import run\n"
                          "from .report import render\nfrom pagedbench.bench import workloads\n",
        "sim/x.py": "from pagedbench.bench.common import records\nfrom pagedbench.bench import environment\n",
    })
    assert layout_violations(bench, {"environment": "common.environment"}) == []


def test_a_kernel_importing_the_engine_is_named(tmp_path):
    (tmp_path / "launch.py").write_text("from pagedbench.refengine.errors import KVCacheError\n")
    (tmp_path / "ok.py").write_text("import triton\nfrom pagedbench.kernels import device\n")
    assert kernel_violations(tmp_path) == ["kernels/launch.py imports pagedbench.refengine"]


def test_bench_top_level_is_a_few_commands_and_no_file_is_over_500_lines():
    top = sorted(p.name for p in BENCH.glob("*.py"))
    assert len(top) <= 10, top
    long = {str(p.relative_to(BENCH)): n for p in BENCH.rglob("*.py")
            if "tests" not in p.relative_to(BENCH).parts and (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_no_engine_file_is_over_500_lines():
    # one reading should hold a file: past 500 lines it is split by responsibility
    engine = BENCH.parent / "refengine"
    long = {str(p.relative_to(engine)): n for p in engine.rglob("*.py")
            if "tests" not in p.relative_to(engine).parts and (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
