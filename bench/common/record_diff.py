"""Differences between two result records of one study (say, run at two commits), less what must differ.

``python -m pagedbench.bench.common.record_diff A.json B.json [--ignore-timing] [--ignore KEY]
[--same A_TEXT B_TEXT]`` prints each difference as ``path: A value != B value`` and exits 1 if there is
any (0 if none). Two ``.md`` reports: their differing lines, ``-`` A's and ``+`` B's.

Always left out: where and when a record was made (``environment``, ``created_utc``, ``git``, ``wall_s``),
since two runs of the same code differ there. With ``ignore_timing`` (studies that time this machine) a
number that is a float, or sits under a timing name (``*_s``, ``*_ms``, ``*_per_s``, ``ratio*``...), is
checked for presence only, and numbers inside strings are masked: the record's shape, its labels, counts
and flags must still agree. ``ignore`` names more keys to leave out (a verdict drawn from timings, say).
``same`` pairs say that text A's strings hold where B's hold other text (each side's own folder, say).
In a report, the environment lines are left out; with ``ignore_timing`` every number is masked and runs
of spaces or dashes (a table's widths) are one.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

#: keys whose values say where and when a record was made, never what it found
ENVIRONMENT_KEYS = frozenset({"environment", "created_utc", "git", "machine", "versions", "wall_s"})
#: names of values measured on the clock (with ``ignore_timing``)
TIMING_NAME = re.compile(r"(_s|_ms|_us|_ns|_per_s|_rps|_gbps|time|ratio|speedup|_min|_max)$|^ratio|^time")
_MD_ENVIRONMENT = re.compile(r"^- (machine|backend|versions|commit): ")
_NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?")
_WIDTH = re.compile(r" {2,}|-{2,}")


def _timed(key: str, value: object) -> bool:
    return (isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)
                                         and TIMING_NAME.search(key) is not None))


def diff_values(a: object, b: object, *, ignore_timing: bool = False, same: tuple[tuple[str, str], ...] = (),
                ignore: frozenset[str] = frozenset(), path: str = "") -> list[str]:
    """Every difference between ``a`` and ``b`` (parsed JSON), as ``path: a != b`` lines (module docstring)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key in ENVIRONMENT_KEYS or key in ignore:
                continue
            if key not in a or key not in b:
                out.append(f"{where}: {'absent' if key not in a else 'present'} != "
                           f"{'absent' if key not in b else 'present'}")
            elif ignore_timing and _timed(str(key), a[key]) and _timed(str(key), b[key]):
                continue
            else:
                out += diff_values(a[key], b[key], ignore_timing=ignore_timing, same=same, ignore=ignore,
                               path=where)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)} items"]
        return [line for i, (x, y) in enumerate(zip(a, b))
                for line in diff_values(x, y, ignore_timing=ignore_timing, same=same, ignore=ignore,
                                        path=f"{path}[{i}]")]
    if isinstance(a, str) and isinstance(b, str):
        for old, new in same:
            a = a.replace(old, new)
        if ignore_timing:
            a, b = _NUMBER.sub("#", a), _NUMBER.sub("#", b)
    if ignore_timing and isinstance(a, float) and isinstance(b, float):
        return []
    if type(a) is not type(b) or a != b:
        return [f"{path}: {a!r} != {b!r}"]
    return []


def report_lines(text: str, *, ignore_timing: bool = False) -> list[str]:
    """A Markdown report's lines less its environment block (and, with ``ignore_timing``, its numbers)."""
    lines = [line for line in text.splitlines() if not _MD_ENVIRONMENT.match(line)]
    return [_WIDTH.sub(" ", _NUMBER.sub("#", line)) for line in lines] if ignore_timing else lines


def diff_reports(a: str, b: str, *, ignore_timing: bool = False, same: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """The lines where two reports differ: ``-`` A's line, ``+`` B's (module docstring)."""
    for old, new in same:
        a = a.replace(old, new)
    la, lb = report_lines(a, ignore_timing=ignore_timing), report_lines(b, ignore_timing=ignore_timing)
    # autojunk off: a long report's blank lines are "popular" and would otherwise never match
    ops = difflib.SequenceMatcher(None, la, lb, autojunk=False).get_opcodes()
    return [line for op, i1, i2, j1, j2 in ops if op != "equal"
            for line in [f"-{x}" for x in la[i1:i2]] + [f"+{y}" for y in lb[j1:j2]]]


def diff_files(a: Path, b: Path, *, ignore_timing: bool = False, same: tuple[tuple[str, str], ...] = (),
               ignore: frozenset[str] = frozenset()) -> list[str]:
    """:func:`diff_values` of two JSON files, or :func:`diff_reports` of two other text files."""
    if a.suffix == ".json":
        return diff_values(json.loads(a.read_text()), json.loads(b.read_text()), ignore_timing=ignore_timing,
                           same=same, ignore=ignore)
    return diff_reports(a.read_text(), b.read_text(), ignore_timing=ignore_timing, same=same)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench.common.record_diff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--ignore-timing", action="store_true", help="check timed values for presence only")
    parser.add_argument("--ignore", action="append", default=[], metavar="KEY",
                        help="leave out this key wherever it is (repeatable)")
    parser.add_argument("--same", nargs=2, action="append", default=[], metavar=("A_TEXT", "B_TEXT"),
                        help="A's strings hold A_TEXT where B's hold B_TEXT (repeatable)")
    parser.add_argument("--limit", type=int, default=20, help="differences printed (default: 20)")
    args = parser.parse_args(argv)
    for p in (args.a, args.b):
        if not p.is_file():
            parser.error(f"no such file: {p}")
    found = diff_files(args.a, args.b, ignore_timing=args.ignore_timing, same=tuple(map(tuple, args.same)),
                       ignore=frozenset(args.ignore))
    for line in found[:args.limit]:
        print(line)
    if len(found) > args.limit:
        print(f"... and {len(found) - args.limit} more")
    print(f"{args.a.name}: {'identical' if not found else f'{len(found)} differences'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
