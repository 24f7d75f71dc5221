"""The gate's result files, written atomically: the JSON summary and a JUnit XML of the same cases.

Every file goes to a temporary name in its folder, is flushed and fsync'ed, then ``os.replace``d over
the final name: a gate killed mid-write leaves the previous file (or none), never a truncated one. The
file gets the mode a plain ``open()`` would give it (0644 under the usual umask), not ``mkstemp``'s 0600,
so results stay readable to everyone who can read the folder.
"""

from __future__ import annotations

import json
import os
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

# read once, at import: os.umask can only be read by setting it
_UMASK = os.umask(0o022)
os.umask(_UMASK)
#: what open() would create a new file with
FILE_MODE = 0o666 & ~_UMASK


def replace_atomically(path: Path, write) -> None:
    """``write(tmp_path)`` fills a temporary file beside ``path``, which is fsync'ed and renamed over it
    (the studies' files and plots go through here too)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, FILE_MODE)
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomically(path: Path, text: str) -> None:
    replace_atomically(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json(path: Path, record: dict) -> None:
    write_atomically(path, json.dumps(record, indent=1, default=str) + "\n")


def junit_xml(impl: str, cases: dict[str, dict], *, failing: set[str]) -> str:
    """JUnit XML (one ``<testcase>`` per case). ``failing``: the ids of cases that fail the gate, shown
    as ``<failure>`` (``fail``, ``accepts invalid``) or ``<error>`` (``error``, ``crashed``); a finding
    that does not fail the gate is a passing test case with its verdict as a property. Measured errors,
    category and verdicts are ``<property>`` elements."""
    suite = ET.Element("testsuite", name=f"pagedbench-conformance[{impl}]", tests=str(len(cases)))
    tallies = {"failures": 0, "errors": 0, "skipped": 0}
    total = 0.0
    for nodeid, entry in cases.items():
        path, _, name = nodeid.partition("::")
        classname = path.removesuffix(".py").replace("/", ".")
        seconds = float(entry.get("seconds", 0.0))
        total += seconds
        case = ET.SubElement(suite, "testcase", classname=classname, name=name or path, time=f"{seconds:.3f}")
        props = ET.SubElement(case, "properties")
        for key in ("outcome", "category", "validation"):
            if key in entry:
                ET.SubElement(props, "property", name=key, value=str(entry[key]))
        for key, value in entry.get("errors", {}).items():
            ET.SubElement(props, "property", name=key, value=repr(value))
        if entry.get("not_supported"):
            ET.SubElement(props, "property", name="not_supported", value=",".join(entry["not_supported"]))
        message = entry.get("message", "")
        outcome = entry["outcome"]
        if outcome in ("not supported", "skipped"):
            ET.SubElement(case, "skipped", message=message[:500])
            tallies["skipped"] += 1
        elif nodeid in failing:
            tag = "error" if outcome in ("error", "crashed") else "failure"
            ET.SubElement(case, tag, type=outcome, message=message[:500]).text = message
            tallies["errors" if tag == "error" else "failures"] += 1
        elif message:
            ET.SubElement(case, "system-out").text = f"{outcome}: {message}"
    for key, value in tallies.items():
        suite.set(key, str(value))
    suite.set("time", f"{total:.3f}")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
