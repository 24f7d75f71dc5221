"""The conformance matrix: implementation x property, built from the gate's JSON files (``make conformance-matrix``).

``python -m pagedbench.conformance.gate.matrix --dir results/conformance --impl triton --impl vllm-unified ...
[--not-installed NAME] [--not-supported NAME=REASON] [--note TEXT]`` reads ``DIR/NAME.json`` for each ``--impl``
and writes, atomically, ``DIR/matrix.md`` and ``DIR/matrix.json``.

A property is a family of the suite: its module (``test_decode.py`` -> ``decode``). Each case of a gate
run is classified once (:func:`classify`):

* ``pass``;
* ``fail`` -- a wrong result, or an exception that is not a rejection (``fail``, ``error``);
* ``not supported`` -- declared or raised ``NotSupported``, or skipped for the machine's sake;
* ``crashed`` -- the worker died or timed out in the case;
* ``bf16 (interpreter)`` -- a bfloat16 case that did not pass while the implementation ran under Triton's
  CPU interpreter, whose bfloat16 arithmetic is not the GPU's: shown apart and not counted as a failure;
* validation cases (``test_kernel_validation``) go to the validation column with their gate verdicts
  (``rejects``, ``accepts-invalid``, ``wrong-error``, ``crashes``, ``check-failed``).

Below the table each failure is listed with its one-line reason and a link to its ``<testcase>`` line in
the implementation's JUnit file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from xml.sax.saxutils import escape

from pagedbench.conformance.gate import report_files
from pagedbench.conformance.gate.environment import host_environment

MATRIX_SCHEMA_VERSION = 1
PROPERTY_OF_MODULE = {
    "test_decode.py": "decode",
    "test_prefill.py": "prefill",
    "test_cache_ops.py": "cache ops",
    "test_host_block_copy.py": "cache ops",
    "test_int64_offsets.py": "int64 offsets",
    "test_metamorphic.py": "metamorphic",
    "test_block_manager.py": "block manager",
    "test_block_manager_scenarios.py": "block manager",
    "test_block_manager_stateful.py": "block manager",
    "test_copy_on_write_data.py": "block manager",
    "test_kernel_validation.py": "validation",
    "test_merge_states.py": "merge / cascade",
    "test_long_context.py": "large blocks, long context",
    "test_gqa_groups.py": "GQA 12/16",
    "test_fp8_kv.py": "fp8 KV",
    "test_engine_metadata.py": "engine metadata",
    "test_batch_invariance.py": "batch invariance (neighbours)",
    "test_dispatch_boundaries.py": "declared dispatch switches",
    "test_strided_layouts.py": "strided views",
    "test_batch_positions.py": "every batch index",
    "test_layer_packed_cache.py": "layer-packed cache",
    "test_tensor_parallel.py": "tensor-parallel shards",
}
PROPERTIES = (
    "decode",
    "prefill",
    "cache ops",
    "int64 offsets",
    "metamorphic",
    "block manager",
    "merge / cascade",
    "large blocks, long context",
    "GQA 12/16",
    "fp8 KV",
    "engine metadata",
    "batch invariance (neighbours)",
    "declared dispatch switches",
    "strided views",
    "every batch index",
    "layer-packed cache",
    "tensor-parallel shards",
)
CLASSES = ("pass", "fail", "not supported", "crashed", "bf16 (interpreter)")
VERDICTS = ("rejects", "accepts-invalid", "wrong-error", "crashes", "check-failed")
REASON_CHARS = 180


def property_of(nodeid: str) -> str:
    module = nodeid.partition("::")[0].rsplit("/", 1)[-1]
    return PROPERTY_OF_MODULE.get(module, "other")


def interpreted(summary: dict) -> bool:
    """Whether the implementation ran under Triton's interpreter, from what it said of itself."""
    device = (summary.get("environment") or {}).get("device") or {}
    backend = device.get("backend") if isinstance(device.get("backend"), dict) else {}
    return bool(device.get("triton_interpret") or backend.get("triton_interpret"))


def classify(nodeid: str, entry: dict, *, interpreter: bool) -> str:
    """The matrix class of one case (module docstring); validation cases get their verdict instead."""
    outcome = entry["outcome"]
    if property_of(nodeid) == "validation" or entry.get("category") == "validation":
        if outcome in ("not supported", "skipped"):
            return "not supported"
        return (
            entry.get("validation")
            or {
                "pass": "rejects",
                "accepts invalid": "accepts-invalid",
                "error": "wrong-error",
                "crashed": "crashes",
                "fail": "check-failed",
            }[outcome]
        )
    if outcome == "pass":
        return "pass"
    if outcome in ("not supported", "skipped"):
        return "not supported"
    if interpreter and "bf16" in nodeid:
        return "bf16 (interpreter)"
    return "crashed" if outcome == "crashed" else "fail"


def reason_of(entry: dict, case: str = "") -> str:
    """The first non-empty line of the case's message, shortened: without the exception name of an
    assertion, nor the case id the message repeats (``case``, the test's id, holds it)."""
    lines = [ln.strip() for ln in str(entry.get("message", "")).splitlines() if ln.strip()]
    text = lines[0].removeprefix("AssertionError: ") if lines else entry["outcome"]
    head, sep, rest = text.partition(": ")
    if sep and "/" in head and head in case:
        text = rest
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def junit_lines(junit_path: Path) -> dict[str, int]:
    """testcase name (the part of a nodeid after ``::``) -> its line in the JUnit file."""
    if not junit_path.exists():
        return {}
    found = {}
    for number, line in enumerate(junit_path.read_text(encoding="utf-8").splitlines(), start=1):
        start = line.find(' name="')
        if "<testcase" in line and start >= 0:
            found.setdefault(line[start + 7 : line.index('"', start + 7)], number)
    return found


def summarize_implementation(name: str, summary: dict, junit_path: Path) -> dict:
    """One row of the matrix (a plain record) from one gate JSON."""
    interpreter = interpreted(summary)
    lines = junit_lines(junit_path)
    counts = {p: dict.fromkeys(CLASSES, 0) for p in PROPERTIES}
    validation = {v: 0 for v in (*VERDICTS, "not supported")}
    listed: dict[str, list[dict]] = {"fail": [], "crashed": [], "bf16 (interpreter)": []}
    for nodeid, entry in summary["cases"].items():
        prop, cls = property_of(nodeid), classify(nodeid, entry, interpreter=interpreter)
        if prop == "validation" or cls in VERDICTS:
            validation[cls] += 1
            continue
        counts.setdefault(prop, dict.fromkeys(CLASSES, 0))[cls] += 1
        if cls in listed:
            testcase = nodeid.partition("::")[2] or nodeid
            listed[cls].append(
                {
                    "case": testcase,
                    "property": prop,
                    "outcome": entry["outcome"],
                    "reason": reason_of(entry, testcase),
                    "junit_line": lines.get(escape(testcase, {'"': "&quot;"})),
                }
            )
    env = summary.get("environment") or {}
    device = env.get("device") or {}
    return {
        "name": name,
        "status": "ran",
        "interpreted": interpreter,
        "device": device,
        "peer_versions": device.get("peer") or {},
        "versions": env.get("versions", {}),
        "git": env.get("git", {}),
        "created_utc": env.get("created_utc"),
        "capabilities": summary.get("capabilities"),
        "pytest_args": summary.get("pytest_args"),
        "counts": counts,
        "validation": validation,
        "failures": listed["fail"],
        "crashes": listed["crashed"],
        "bf16_interpreter": listed["bf16 (interpreter)"],
        "json": f"{name}.json",
        "junit": f"{name}.junit.xml",
    }


def build(
    directory: Path,
    impls: list[str],
    not_installed: list[str],
    note: str | None = None,
    not_supported: dict[str, str] | None = None,
) -> dict:
    """The matrix record: a row per ``impls`` name from its JSON, then one per ``not_installed`` name and
    one per ``not_supported`` name (name -> why it cannot run on this machine, e.g. "needs CUDA")."""
    rows = []
    for name in impls:
        path = directory / f"{name}.json"
        if not path.exists():
            rows.append({"name": name, "status": "no result", "reason": f"{path.name} is missing"})
            continue
        rows.append(summarize_implementation(name, json.loads(path.read_text()), directory / f"{name}.junit.xml"))
    rows += [
        {"name": name, "status": "not installed", "reason": "the peers venv (`make peers`) is absent"}
        for name in not_installed
    ]
    rows += [
        {"name": name, "status": "not supported", "reason": reason} for name, reason in (not_supported or {}).items()
    ]
    return {
        "schema_version": MATRIX_SCHEMA_VERSION,
        "environment": host_environment(),
        "note": note,
        "properties": list(PROPERTIES),
        "classes": list(CLASSES),
        "implementations": rows,
    }


def _name_and_reason(text: str) -> tuple[str, str]:
    name, sep, reason = text.partition("=")
    if not (sep and name and reason):
        raise argparse.ArgumentTypeError(f"expected NAME=REASON, got {text!r}")
    return name, reason


def main(argv: list[str] | None = None) -> int:
    from pagedbench.conformance.gate.matrix_markdown import render

    parser = argparse.ArgumentParser(prog="python -m pagedbench.conformance.gate.matrix",
                                     description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path("results/conformance"),
        help="where the gate wrote NAME.json / NAME.junit.xml; the matrix goes there too",
    )
    parser.add_argument("--impl", action="append", default=[], help="an implementation whose gate ran")
    parser.add_argument(
        "--not-installed",
        action="append",
        default=[],
        metavar="NAME",
        help="an implementation that could not run here (a row saying so)",
    )
    parser.add_argument(
        "--not-supported",
        action="append",
        default=[],
        type=_name_and_reason,
        metavar="NAME=REASON",
        help="an implementation that cannot run on this machine, and why (a row: 'not supported: REASON')",
    )
    parser.add_argument("--note", help="a line for the top of matrix.md (e.g. the case selection used)")
    args = parser.parse_args(argv)
    matrix = build(args.dir, args.impl, args.not_installed, args.note, dict(args.not_supported))
    report_files.write_json(args.dir / "matrix.json", matrix)
    report_files.write_atomically(args.dir / "matrix.md", render(matrix))
    print(f"wrote {args.dir / 'matrix.md'} and {args.dir / 'matrix.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
