"""The conformance matrix from synthetic gate files: every class of case lands where it should."""

from __future__ import annotations

import json
from pathlib import Path

from pagedbench.conformance.gate import matrix, report_files

DECODE = "conformance/suite/test_decode.py::test_decode_matches_oracle"
PREFILL = "conformance/suite/test_prefill.py::test_prefill_matches_oracle"
VALIDATION = "conformance/suite/test_kernel_validation.py::test_decode_rejects_mismatched_shapes"
CASES = {
    f"{DECODE}[x-decode/bs=16,ctx=97,fp16]": {"outcome": "pass", "category": "numerics"},
    f"{DECODE}[x-decode/bs=16,ctx=0+5,fp16]": {
        "outcome": "fail",
        "category": "numerics",
        "message": "decode/bs=16,ctx=0+5,fp16: out: 4 non-finite values\nassert False",
    },
    f"{DECODE}[x-decode/bs=16,ctx=3000,fp32]": {
        "outcome": "crashed",
        "category": "numerics",
        "message": "worker killed by SIGSEGV while this case ran",
    },
    f"{DECODE}[x-decode/bs=16,ctx=97,bf16]": {"outcome": "fail", "category": "numerics", "message": "rel error 2e-2"},
    f"{PREFILL}[x-prefill/bs=5,ctx=9,fp16]": {
        "outcome": "not supported",
        "category": "numerics",
        "message": "not supported: x does not support block_size 5",
    },
    f"{PREFILL}[x-prefill/bs=16,ctx=9,fp16]": {
        "outcome": "error",
        "category": "numerics",
        "message": "IndexError: out of range",
    },
    f"{VALIDATION}[x-q-rank]": {"outcome": "pass", "category": "validation", "validation": "rejects"},
    f"{VALIDATION}[x-q-num-seqs]": {
        "outcome": "accepts invalid",
        "category": "validation",
        "validation": "accepts-invalid",
    },
}


def write_gate_files(directory, name: str, *, interpreter: bool) -> None:
    summary = {
        "implementation": name,
        "cases": CASES,
        "pytest_args": ["-m", "not slow"],
        "environment": {
            "device": {"device": "cpu", "triton_interpret": interpreter, "peer": {"x": "1.0"}},
            "versions": {"torch": "2.13.0"},
            "git": {"commit": "abc", "dirty": False},
        },
    }
    report_files.write_json(directory / f"{name}.json", summary)
    failing = {n for n, e in CASES.items() if e["outcome"] not in ("pass", "not supported")}
    report_files.write_atomically(directory / f"{name}.junit.xml", report_files.junit_xml(name, CASES, failing=failing))


def test_each_class_of_case_is_counted_where_it_belongs(tmp_path):
    write_gate_files(tmp_path, "interp", interpreter=True)
    write_gate_files(tmp_path, "native", interpreter=False)
    built = matrix.build(tmp_path, ["interp", "native"], ["absent"])
    interp, native, absent = built["implementations"]
    assert interp["counts"]["decode"] == {
        "pass": 1,
        "fail": 1,
        "not supported": 0,
        "crashed": 1,
        "bf16 (interpreter)": 1,
    }
    assert interp["counts"]["prefill"] == {
        "pass": 0,
        "fail": 1,
        "not supported": 1,
        "crashed": 0,
        "bf16 (interpreter)": 0,
    }
    # the same bfloat16 miss without the interpreter is a failure like any other
    assert native["counts"]["decode"]["fail"] == 2 and native["counts"]["decode"]["bf16 (interpreter)"] == 0
    assert interp["validation"]["rejects"] == 1 and interp["validation"]["accepts-invalid"] == 1
    assert all(sum(c.values()) == 0 for p, c in interp["counts"].items() if p not in ("decode", "prefill"))
    assert absent["status"] == "not installed"


def test_failures_carry_their_first_line_and_a_link_to_their_testcase(tmp_path):
    write_gate_files(tmp_path, "interp", interpreter=True)
    row = matrix.build(tmp_path, ["interp"], [])["implementations"][0]
    fail = next(f for f in row["failures"] if "ctx=0+5" in f["case"])
    assert fail["reason"] == "out: 4 non-finite values"  # the case id it repeats is in the test's id
    error = next(f for f in row["failures"] if f["outcome"] == "error")
    assert error["reason"] == "IndexError: out of range"
    junit = (tmp_path / "interp.junit.xml").read_text().splitlines()
    assert 'test_decode_matches_oracle[x-decode/bs=16,ctx=0+5,fp16]"' in junit[fail["junit_line"] - 1]
    assert [c["case"] for c in row["crashes"]] == ["test_decode_matches_oracle[x-decode/bs=16,ctx=3000,fp32]"]
    assert [c["case"] for c in row["bf16_interpreter"]] == ["test_decode_matches_oracle[x-decode/bs=16,ctx=97,bf16]"]
    assert {f["outcome"] for f in row["failures"]} == {"fail", "error"}


def test_main_writes_the_markdown_and_json(tmp_path):
    write_gate_files(tmp_path, "interp", interpreter=True)
    assert (
        matrix.main(
            ["--dir", str(tmp_path), "--impl", "interp", "--not-installed", "absent", "--note", "a smaller grid"]
        )
        == 0
    )
    text = (tmp_path / "matrix.md").read_text()
    assert "| interp " in text and "x 1.0" in text and "1 / 1 / 0 / 1" in text and "a smaller grid" in text
    assert "| absent " in text and "not installed" in text
    assert "interp.junit.xml#L" in text and "4 non-finite values" in text
    assert json.loads((tmp_path / "matrix.json").read_text())["implementations"][1]["status"] == "not installed"
    assert not list(tmp_path.glob(".*.tmp"))


def test_every_suite_module_has_a_column():
    suite = Path(matrix.__file__).resolve().parents[1] / "suite"
    modules = sorted(p.name for p in suite.glob("test_*.py"))
    assert modules, suite
    assert [m for m in modules if m not in matrix.PROPERTY_OF_MODULE] == []  # else its cases vanish into "other"
    assert set(matrix.PROPERTY_OF_MODULE.values()) - {"validation"} == set(matrix.PROPERTIES)
