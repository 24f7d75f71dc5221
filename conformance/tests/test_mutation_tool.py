"""The mutation check's own machinery (``make mutants`` runs the real thing): the operators rewrite
exactly their span into valid Python, every operator still finds sites in the real files it targets,
the equivalence list names mutants that exist, the sampling is deterministic, and the runner classifies
a killed, a crashed, a hung and a surviving mutant of a tiny fake project (no Triton, no torch)."""

from __future__ import annotations

import ast
import json
import textwrap

import pytest
from pagedbench.conformance.mutation import check as mutation_check
from pagedbench.conformance.mutation import equivalents as mutation_equivalents
from pagedbench.conformance.mutation import operators as ops
from pagedbench.conformance.mutation.runner import Workspace, classify, run_tests

KERNEL = textwrap.dedent("""
    import triton
    import triton.language as tl


    @triton.jit
    def _k(x_ptr, out_ptr, n, a_ptr):
        i = tl.program_id(0).to(tl.int64)
        offs = i * 16 + tl.arange(0, 16)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        s = tl.dot(x, tl.trans(x))
        safe = tl.where(x == float("-inf"), 0.0, x)
        tl.store(out_ptr + offs, x + safe, mask=m)


    def host(a, b):
        return a <= b
""")

HOST = textwrap.dedent("""
    def _copy_on_write_last_block(seq):
        last = seq.blocks[-1]
        if last.ref_count == 1:
            return None
        last.ref_count -= 1
        return last


    def kept(logits, temperature, cum, sorted_probs, top_p):
        x = logits / temperature[:, None]
        return (cum - sorted_probs) < top_p, x[: len(x) - 1]
""")


def one(source: str, operator: str) -> list[ops.Mutant]:
    return ops.mutants_of("m.py", source, {operator: ops.OPERATORS[operator]})


def changed_lines(a: str, b: str) -> list[tuple[str, str]]:
    return [(x, y) for x, y in zip(a.splitlines(), b.splitlines()) if x != y]


@pytest.mark.parametrize(
    "operator,expected",
    [
        ("int32_offset", [("i = tl.program_id(0).to(tl.int64)", "i = tl.program_id(0)")]),
        ("bound_plus_one", [("m = offs < n", "m = offs < (n) + 1")]),
        ("bound_minus_one", [("m = offs < n", "m = offs < (n) - 1")]),
        (
            "drop_mask",
            [
                ("x = tl.load(x_ptr + offs, mask=m, other=0.0)", "x = tl.load(x_ptr + offs)"),
                ("tl.store(out_ptr + offs, x + safe, mask=m)", "tl.store(out_ptr + offs, x + safe)"),
            ],
        ),
        ("swap_dot_operands", [("s = tl.dot(x, tl.trans(x))", "s = tl.dot(tl.trans(x), x)")]),
        ("drop_inf_guard", [('safe = tl.where(x == float("-inf"), 0.0, x)', "safe = x")]),
    ],
)
def test_kernel_operators_rewrite_exactly_their_span(operator, expected):
    mutants = one(KERNEL, operator)
    got = [changed_lines(KERNEL, m.source)[0] for m in mutants]
    assert [(a.strip(), b.strip()) for a, b in got] == expected
    for m in mutants:
        ast.parse(m.source)
        assert len(changed_lines(KERNEL, m.source)) == 1  # nothing else moved: the kernel's source stays as written
        assert m.function == "_k" and m.source.count("@triton.jit") == 1


def test_compare_boundary_skips_kernel_bounds_and_host_code_of_kernel_files():
    # kernel files: the kernels' comparisons other than the `<` bounds (the bound operators take those)
    assert one(KERNEL, "compare_boundary") == []
    (m,) = one("def f(a, b):\n    return a <= b\n", "compare_boundary")
    assert m.mutated == "a < b" and m.source == "def f(a, b):\n    return a < b\n"


@pytest.mark.parametrize(
    "operator,expected",
    [
        ("skip_cow", [("if last.ref_count == 1:", "if True:")]),
        (
            "ref_count_off_by_one",
            [("last.ref_count -= 1", "last.ref_count -= 0"), ("last.ref_count -= 1", "last.ref_count -= 2")],
        ),
        (
            "sampler_arith",
            [
                ("x = logits / temperature[:, None]", "x = logits * temperature[:, None]"),
                ("return (cum - sorted_probs) < top_p, x[: len(x) - 1]", "return (cum) < top_p, x[: len(x) - 1]"),
            ],
        ),
        (
            "const_off_by_one",
            [
                (
                    "return (cum - sorted_probs) < top_p, x[: len(x) - 1]",
                    "return (cum - sorted_probs) < top_p, x[: len(x)]",
                )
            ],
        ),
    ],
)
def test_host_operators_rewrite_exactly_their_span(operator, expected):
    mutants = one(HOST, operator)
    assert [tuple(s.strip() for s in changed_lines(HOST, m.source)[0]) for m in mutants] == expected
    for m in mutants:
        ast.parse(m.source)


TIER = textwrap.dedent("""
    def store(self, b, hid):
        if b.block_id in self._loading:
            return
        self._entries.move_to_end(b.block_hash)
        self._stores.append((b.block_id, hid))
        plan.append(BlockSwap(b.block_id, hid))


    def evict(self):
        for h, e in self._entries.items():
            if not e.pinned:
                del self._entries[h]
                return h


    def cut(w, r, part):
        return w[slice(r * part, (r + 1) * part)]
""")


@pytest.mark.parametrize(
    "operator,expected",
    [
        ("drop_guard", [("if b.block_id in self._loading:", "if False and (b.block_id in self._loading):")]),
        (
            "eviction_order",
            [
                ("self._entries.move_to_end(b.block_hash)", "self._entries.move_to_end(b.block_hash, last=False)"),
                ("for h, e in self._entries.items():", "for h, e in reversed(list(self._entries.items())):"),
                ("if not e.pinned:", "if True or (not e.pinned):"),
            ],
        ),
        (
            "copy_direction",
            [
                ("self._stores.append((b.block_id, hid))", "self._stores.append((hid, b.block_id))"),
                ("plan.append(BlockSwap(b.block_id, hid))", "plan.append(BlockSwap(hid, b.block_id))"),
            ],
        ),
        (
            "range_off_by_one",
            [
                ("return w[slice(r * part, (r + 1) * part)]", "return w[slice((r * part) + 1, ((r + 1) * part) + 1)]"),
                ("return w[slice(r * part, (r + 1) * part)]", "return w[slice(r * part, ((r + 1) * part) + 1)]"),
            ],
        ),
    ],
)
def test_host_tier_and_shard_operators_rewrite_exactly_their_span(operator, expected):
    mutants = one(TIER, operator)
    assert [tuple(s.strip() for s in changed_lines(TIER, m.source)[0]) for m in mutants] == expected
    for m in mutants:
        assert len(changed_lines(TIER, m.source)) == 1
        ast.parse(m.source)


def test_range_off_by_one_takes_subscript_ranges_with_both_bounds_only():
    got = [m.mutated for m in one("def f(t, i, n):\n    return t[i:n], t[:n], t[i:], t[i:n:2]\n", "range_off_by_one")]
    assert got == ["(i) + 1:(n) + 1", "(n) + 1"]


def test_every_operator_still_finds_sites_in_the_files_it_targets():
    found = mutation_check.all_mutants()
    for target in mutation_check.TARGETS:
        for name in target.operators:
            if name in ("swap_dot_operands", "drop_inf_guard") and "cache_kernels" in target.path:
                continue  # the cache kernels have no dot and no softmax
            assert any(m.path == target.path and m.operator == name for _, m in found), (target.path, name)


def test_every_equivalent_entry_names_a_mutant_the_operators_make():
    keys = {mutation_equivalents.key_of(m) for _, m in mutation_check.all_mutants()}
    stale = [k for k in mutation_equivalents.EQUIVALENT if k not in keys]
    assert not stale, f"equivalence entries that match no mutant of today's source: {stale}"


def test_the_default_runs_every_mutant(capsys, monkeypatch):
    """No sampling unless asked: ``--list`` with the default options names every mutant the operators make."""
    found = mutation_check.all_mutants()
    monkeypatch.setattr(mutation_check, "all_mutants", lambda: found)
    monkeypatch.setattr(mutation_check, "host_environment", dict)  # no git calls: nothing is written
    assert mutation_check.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert sorted(listed) == sorted(m.mutant_id for _, m in found)
    assert len(mutation_check.sample(found)) == len(listed)


def test_sampling_is_deterministic_and_capped():
    found = mutation_check.all_mutants()
    a = mutation_check.sample(found, per_operator=3, max_mutants=40, seed=1)
    b = mutation_check.sample(found, per_operator=3, max_mutants=40, seed=1)
    assert [m.mutant_id for _, m in a] == [m.mutant_id for _, m in b] and len(a) == 40
    groups: dict[tuple[str, str], int] = {}
    for _, m in a:
        groups[(m.path, m.operator)] = groups.get((m.path, m.operator), 0) + 1
    assert max(groups.values()) <= 3


def test_classify_tells_assertions_from_exceptions_crashes_and_hangs():
    failed = (
        "pagedbench/x/test_a.py::test_one PASSED\npagedbench/x/test_a.py::test_two FAILED\n"
        "FAILED pagedbench/x/test_a.py::test_two - AssertionError: out: 3 values differ\n"
    )
    r = classify(1, failed, 1.0, 60)
    assert (r.outcome, r.test) == ("killed", "x/test_a.py::test_two") and "differ" in r.detail
    r = classify(1, failed.replace("AssertionError", "TypeError"), 1.0, 60)
    assert r.outcome == "error"
    r = classify(-11, "pagedbench/x/test_a.py::test_one PASSED\npagedbench/x/test_a.py::test_two ", 1.0, 60)
    assert (r.outcome, r.test, r.detail) == ("crashed", "x/test_a.py::test_two", "killed by SIGSEGV")
    r = classify(None, "pagedbench/x/test_a.py::test_one ", 60.0, 60)
    assert (r.outcome, r.test) == ("timeout", "x/test_a.py::test_one")
    assert classify(0, "1 passed", 1.0, 60).outcome == "survived"
    assert classify(2, "ERROR collecting pagedbench/x/test_a.py", 1.0, 60).outcome == "error"


FAKE_MODULE = "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"
FAKE_TEST = textwrap.dedent("""
    from pagedbench.refengine.mathy import clamp


    def test_clamp():
        assert clamp(5, 0, 3) == 3
        assert clamp(-1, 0, 3) == 0
""")


def test_the_runner_classifies_mutants_of_a_fake_project_in_a_private_copy(tmp_path):
    repo = tmp_path / "repo"
    (repo / "refengine" / "tests").mkdir(parents=True)
    (repo / "refengine" / "__init__.py").write_text("")
    (repo / "refengine" / "mathy.py").write_text(FAKE_MODULE)
    (repo / "refengine" / "tests" / "test_mathy.py").write_text(FAKE_TEST)
    ws = Workspace(repo, parent=tmp_path, packages=("refengine",))
    tests = ("refengine/tests/test_mathy.py",)
    try:
        assert run_tests(ws, tests, 120).outcome == "survived"
        broken = {
            "killed": FAKE_MODULE.replace("min(x, hi)", "x"),
            "error": FAKE_MODULE.replace("return", "raise ValueError; return"),
            "crashed": "import os\n" + FAKE_MODULE.replace("return", "os.abort(); return"),
            "timeout": FAKE_MODULE.replace("return", "while True: pass\n    return"),
        }
        for outcome, source in broken.items():
            ws.write("refengine/mathy.py", source)
            r = run_tests(ws, tests, 8 if outcome == "timeout" else 120)
            ws.restore("refengine/mathy.py")
            assert (r.outcome, r.test) == (outcome, "refengine/tests/test_mathy.py::test_clamp"), r
        assert ws.copy_of("refengine/mathy.py").read_text() == FAKE_MODULE  # restored
    finally:
        ws.remove()
    assert (repo / "refengine" / "mathy.py").read_text() == FAKE_MODULE  # the tree itself never written
    assert not ws.root.exists()


def test_the_report_renders_every_outcome_and_the_equivalence_reason(tmp_path):
    from pagedbench.conformance.mutation.check import Target, Verdict
    from pagedbench.conformance.mutation.report import write_report
    from pagedbench.conformance.mutation.runner import RunResult

    target = Target("m.py", ("compare_boundary",), ("t.py",))
    (m,) = one("def f(a, b):\n    return a <= b\n", "compare_boundary")
    verdicts = [
        Verdict(target, m, RunResult(o, "t.py::test_f" if o != "survived" else "", "why", 1.0, 1), reason)
        for o, reason in [
            ("killed", None),
            ("error", None),
            ("crashed", None),
            ("timeout", None),
            ("survived", None),
            ("survived", "no caller can tell"),
        ]
    ]
    base = {"m.py": RunResult("survived", "", "", 2.0, 0)}
    rec = write_report(tmp_path, verdicts, base=base, found=9, seconds=60.0, options={}, planned=8, complete=False)
    assert rec["score"] == {"killed": 1, "error": 1, "crashed": 1, "timeout": 1, "equivalent": 1, "survived": 1}
    text = (tmp_path / "mutation.md").read_text()
    assert "**Score: 4 of 6 killed**" in text and "Partial: the run was stopped after 6 of its 8 mutants" in text
    assert "no caller can tell" in text and "SURVIVED" in text and "`a <= b` → `a < b`" in text
    assert json.loads((tmp_path / "mutation.json").read_text())["mutants"][5]["equivalent"] == "no caller can tell"


def test_a_rerun_with_only_updates_its_rows_and_keeps_the_others(tmp_path):
    from pagedbench.conformance.gate.environment import host_environment
    from pagedbench.conformance.mutation.check import Target, Verdict, earlier_report
    from pagedbench.conformance.mutation.report import write_report
    from pagedbench.conformance.mutation.runner import RunResult

    target = Target("m.py", ("compare_boundary",), ("t.py",))
    first, second = one("def f(a, b):\n    return a <= b\n\n\ndef g(a, b):\n    return a >= b\n", "compare_boundary")
    base = {"m.py": RunResult("survived", "", "", 2.0, 0)}
    env = host_environment()
    full_env = {**env, "git": {"commit": "a" * 40, "dirty": False}}
    rerun_env = {**env, "git": {"commit": "b" * 40, "dirty": False}}
    survived = RunResult("survived", "", "", 1.0, 0)
    write_report(tmp_path, [Verdict(target, m, survived, None) for m in (first, second)], base=base, found=2,
                 seconds=600.0, options={"only": []}, environment=full_env)
    previous = earlier_report(tmp_path, {first.mutant_id, second.mutant_id})
    killed = RunResult("killed", "t.py::test_g", "AssertionError", 1.0, 1)
    rec = write_report(tmp_path, [Verdict(target, second, killed, None)], base=base, found=2, seconds=60.0,
                       options={"only": ["g"]}, environment=rerun_env, previous=previous, files=["m.py"])
    assert [(r["id"], r["outcome"], r["commit"]) for r in rec["mutants"]] == [
        (first.mutant_id, "survived", "a" * 40),
        (second.mutant_id, "killed", "b" * 40),
    ]
    assert rec["score"]["survived"] == 1 and rec["score"]["killed"] == 1 and rec["complete"]
    assert [r["commit"] for r in rec["runs"]] == ["a" * 40, "b" * 40] and rec["seconds"] == 660.0
    text = (tmp_path / "mutation.md").read_text()
    assert "Made in 2 runs" in text and "`--only g`" in text and f"*re-run* at `{'b' * 10}`" in text
    assert earlier_report(tmp_path, {first.mutant_id})["mutants"][0]["id"] == first.mutant_id  # stale rows go
    assert len(earlier_report(tmp_path, {first.mutant_id})["mutants"]) == 1
