"""Every import path the README documents still imports, under the one `pagedbench` prefix, and the
installed distribution owns no top-level import name but `pagedbench`."""

from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: module -> names the README's examples and tables import from it
DOCUMENTED = {
    "pagedbench.refengine": ["BlockManager", "BlockManagerMetrics", "BlockPool", "ContiguousBlockManager",
                             "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig",
                             "load_model", "LoadedModel", "AttentionMetadata", "get_attention_backend"],
    "pagedbench.refengine.errors": ["KVCacheError", "OutOfBlocksError", "UnknownSequenceError",
                                    "DuplicateSequenceError", "InvalidArgumentError", "InvalidRequestError"],
    "pagedbench.conformance.adapter": ["Implementation", "register", "NotSupported"],
    "pagedbench.kernels": ["paged_decode", "paged_prefill", "write_kv", "copy_blocks", "contiguous_decode"],
    "pagedbench.kernels.reference": ["paged_decode", "paged_prefill", "write_kv", "copy_blocks",
                                     "contiguous_decode"],
    "pagedbench.kernels.device": ["backend"],
    "pagedbench.conformance.implementations": [],
    "pagedbench.conformance.gate.runner": ["main"],
    "pagedbench.bench.workloads": [],
    "pagedbench.bench.environment": ["environment"],
}

#: the flat layout's modules (the README's layout listed them) and a name each must still give
FLAT = {
    "block_pool": "BlockPool", "block_manager": "BlockManager", "free_block_queue": "FreeBlockQueue",
    "prefix_hash": None, "block_manager_checks": "check_invariants", "arena": "make_allocator",
    "contiguous": "ContiguousBlockManager", "model_config": "ModelConfig", "model": "LlamaModel",
    "loader": "load_model", "attention_backend": "AttentionMetadata", "sampling": "SamplingParams",
    "sequence": "Sequence", "scheduler": "Scheduler", "engine": "LLM", "engine_stats": "LLMStats",
    "outputs": "RequestOutput", "errors": "KVCacheError",
}


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_documented_module_imports(module):
    mod = importlib.import_module(module)
    missing = [n for n in DOCUMENTED[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"


@pytest.mark.parametrize("old", sorted(FLAT))
def test_flat_refengine_paths_still_import(old):
    mod = importlib.import_module(f"pagedbench.refengine.{old}")
    if FLAT[old] is not None:
        assert hasattr(mod, FLAT[old]), f"pagedbench.refengine.{old} lacks {FLAT[old]}"


def test_flat_alias_is_the_same_module():
    import pagedbench.refengine.block_manager as old
    import pagedbench.refengine.kv.block_manager as new

    assert old is new  # one module: one BlockManager class, isinstance checks agree


def test_scheduler_and_kv_managers_import_no_torch():
    code = ("import sys; import pagedbench.refengine.engine.scheduler, pagedbench.refengine.kv.block_manager, "
            "pagedbench.refengine.kv.contiguous, pagedbench.refengine.engine.sequence; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pagedbench.kernels')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_wheel_has_one_top_level_name(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("pagedbench-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"pagedbench"}, tops
    assert not any("/tests/" in n for n in names), "our own tests do not ship"
    for data in ("pagedbench/bench/configs/memory.yaml", "pagedbench/conformance/suite/test_decode.py"):
        assert data in names, f"{data} missing from the wheel"


def test_huggingface_kernels_imports_beside_pagedbench(tmp_path):
    """Hugging Face's `kernels` owns the top-level name `kernels`; with both installed, each imports."""
    site = tmp_path / "site"
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(ROOT)], check=True, capture_output=True, timeout=300)
    ours = next(wheel_dir.glob("pagedbench-*.whl"))
    theirs = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                             "kernels==0.17.2"], capture_output=True, text=True, timeout=300)
    if theirs.returncode != 0:
        pytest.skip(f"Hugging Face's kernels 0.17.2 could not be installed here: {theirs.stderr[-300:]}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(ours)],
                   check=True, capture_output=True, timeout=300)
    code = ("import kernels, pagedbench.kernels as ours; "
            "assert hasattr(kernels, 'get_kernel'), kernels.__file__; "
            "assert hasattr(ours, 'paged_decode'); print(kernels.__file__, ours.__file__)")
    # run outside the repository, on the installed copies only (-I: no cwd, no user site)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    hf_file, our_file = out.stdout.split()
    assert hf_file.startswith(str(site / "kernels")) and our_file.startswith(str(site / "pagedbench"))


def test_a_test_session_leaves_the_bare_kernels_name_to_hugging_face():
    """Collecting this tree imports our kernels/ under the bare name ``kernels``; where Hugging Face's
    ``kernels`` is installed (transformers >= 5.25 requires it), that name must stay theirs in the session."""
    from importlib import metadata

    try:
        metadata.version("kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed")
    module = sys.modules.get("kernels") or importlib.import_module("kernels")
    assert Path(module.__file__).resolve() != ROOT / "kernels" / "__init__.py"


def test_every_subpackage_is_in_the_explicit_packages_list():
    """pyproject lists its packages by hand (the ``pagedbench.`` folder mapping needs it): a subpackage left
    out still imports from an editable install, so only this test would notice the wheel lacking it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, folders = set(config["packages"]), config["package-dir"]  # (data folders are listed too)
    found = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if "tests" in parts or "micro" in parts:  # test code is not shipped
                continue
            found.add(".".join((name, *parts)))
    assert found - listed == set(), f"subpackages missing from pyproject's packages: {sorted(found - listed)}"


def test_kernels_import_nothing_from_above():
    """Imports point one way: the kernels package (its modules, not its tests) imports neither the engine,
    the conformance suite nor the harness (the compile check's report is a bench study for that reason)."""
    import re

    upward = re.compile(r"^\s*(from|import)\s+pagedbench\.(refengine|conformance|bench)\b", re.M)
    offenders = [p.name for p in sorted((ROOT / "kernels").glob("*.py")) if upward.search(p.read_text())]
    assert offenders == [], f"kernels modules importing from above: {offenders}"
