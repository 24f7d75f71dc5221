"""Strict reading of one flat YAML profile: every field present, of its type, in its range, nothing extra.

A profile is a hand-edited file whose numbers feed every study, so a typo must stop the run with the
file, the field and the line, never fall back to a default. :func:`read_profile` returns the fields
as a plain dict; the caller builds its frozen dataclass from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class ProfileError(ValueError):
    """A profile file is missing, unknown, or holds a field that is absent, mistyped or out of range.

    ``path`` is the file, ``field`` the offending field (``None`` for whole-file problems) and
    ``line`` its 1-based line when YAML gives one.
    """

    def __init__(self, path: Path | str, field: str | None, line: int | None, problem: str) -> None:
        where = str(path) + (f":{line}" if line is not None else "")
        what = f"field {field!r}: " if field is not None else ""
        super().__init__(f"{where}: {what}{problem}")
        self.path = Path(path)
        self.field = field
        self.line = line


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One expected field: its Python type and a range check (``None``: any value of the type)."""

    kind: type  # int, float, str or bool; an int is accepted where a float is expected
    check: Callable[[Any], bool] | None = None
    check_text: str = ""  # what `check` demands, for the message ("> 0")


def positive(kind: type) -> FieldSpec:
    return FieldSpec(kind, lambda v: v > 0, "> 0")


def non_negative(kind: type) -> FieldSpec:
    return FieldSpec(kind, lambda v: v >= 0, ">= 0")


def fraction() -> FieldSpec:
    return FieldSpec(float, lambda v: 0 < v <= 1, "in (0, 1]")


def one_of(*choices: str) -> FieldSpec:
    return FieldSpec(str, lambda v: v in choices, f"one of {list(choices)}")


def _type_ok(value: Any, kind: type) -> bool:
    # bool is an int subclass in Python; `layers: true` must not pass as 1.
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _key_lines(text: str) -> dict[str, int]:
    """Top-level key -> 1-based line, from the YAML node tree (the parsed dict forgets lines)."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(k.value): k.start_mark.line + 1 for k, _ in node.value}


@dataclass(frozen=True, slots=True)
class ProfileFields:
    """What :func:`read_profile` read: checked values, and each field's line for later messages."""

    values: dict[str, Any]
    lines: dict[str, int]

    def error(self, path: Path, field: str, problem: str) -> ProfileError:
        return ProfileError(path, field, self.lines.get(field), problem)


def read_profile(path: Path, specs: Mapping[str, FieldSpec]) -> ProfileFields:
    """The fields of ``path`` checked against ``specs``; floats come back as float.

    Raises :class:`ProfileError` for an unreadable or non-mapping file, a missing or unexpected
    field, a value of the wrong type, or one outside its range.
    """
    try:
        text = path.read_text()
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ProfileError(path, None, mark.line + 1 if mark else None, f"not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ProfileError(path, None, None, f"expected a mapping of fields, got {type(data).__name__}")
    lines = _key_lines(text)
    for name in data:
        if name not in specs:
            raise ProfileError(path, str(name), lines.get(str(name)),
                               f"unexpected field (expected only {sorted(specs)})")
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        if name not in data:
            raise ProfileError(path, name, None, "missing")
        value, line = data[name], lines.get(name)
        if not _type_ok(value, spec.kind):
            hint = ""
            if isinstance(value, str) and _looks_numeric(value):
                hint = " (YAML 1.1 reads 1.5e12 as a string: write 1.5e+12)"
            raise ProfileError(path, name, line,
                               f"expected {spec.kind.__name__}, got {type(value).__name__} {value!r}{hint}")
        if spec.check is not None and not spec.check(value):
            raise ProfileError(path, name, line, f"expected {spec.check_text}, got {value!r}")
        out[name] = float(value) if spec.kind is float else value
    return ProfileFields(out, lines)


def profile_path(directory: Path, name: str) -> Path:
    """``directory/name.yaml``, or a :class:`ProfileError` listing the profiles that exist."""
    path = directory / f"{name}.yaml"
    if "/" in name or not path.is_file():
        known = sorted(p.stem for p in directory.glob("*.yaml"))
        raise ProfileError(path, None, None, f"unknown profile {name!r} (known: {known})")
    return path
