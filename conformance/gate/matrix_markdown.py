"""``matrix.md``, rendered from the record ``conformance.gate.matrix.build`` returns (tables with ``tabulate``)."""

from __future__ import annotations

import itertools

from tabulate import tabulate

LEGEND = (
    "Each property cell is **pass / fail / not supported / crashed** over that family's cases; "
    "*bf16 (interp.)* counts bfloat16 cases that did not pass under Triton's CPU interpreter, whose "
    "bfloat16 arithmetic is not the GPU's: they are listed, not counted as failures. The validation "
    "column gives the gate's verdicts on bad arguments (`rejects` is the wanted one; "
    "`accepts-invalid`: the call returned normally)."
)


def _cell(counts: dict) -> str:
    if not any(counts.values()):
        return "-"
    return f"{counts['pass']} / {counts['fail']} / {counts['not supported']} / {counts['crashed']}"


def _validation_cell(validation: dict) -> str:
    parts = [f"{n} {verdict}" for verdict, n in validation.items() if n and verdict != "not supported"]
    if validation.get("not supported"):
        parts.append(f"{validation['not supported']} n/s")
    return ", ".join(parts) or "-"


def _version(row: dict) -> str:
    peers = row.get("peer_versions") or {}
    if peers:
        return ", ".join(f"{k} {v}" for k, v in peers.items())
    return f"pagedbench {row.get('versions', {}).get('pagedbench') or '?'}"


def _status(row: dict) -> str:
    """The cell of a row that did not run: "not installed", "no result", "not supported: needs CUDA"."""
    return f"{row['status']}: {row['reason']}" if row["status"] == "not supported" else row["status"]


def _table(matrix: dict) -> str:
    props = matrix["properties"]
    headers = ["implementation", "version", *props, "validation", "bf16 (interp.)"]
    rows = []
    for row in matrix["implementations"]:
        if row["status"] != "ran":
            status = _status(row)
            rows.append([row["name"], "-", *([status] * len(props)), status, "-"])
            continue
        counts = row["counts"]
        bf16 = sum(c["bf16 (interpreter)"] for c in counts.values())
        rows.append(
            [
                row["name"],
                _version(row),
                *(_cell(counts[p]) for p in props),
                _validation_cell(row["validation"]),
                str(bf16) if row["interpreted"] else "n/a",
            ]
        )
    return tabulate(rows, headers=headers, tablefmt="github")


def _environment(matrix: dict) -> str:
    rows = []
    for row in matrix["implementations"]:
        if row["status"] != "ran":
            rows.append([row["name"], row.get("reason", ""), "", "", "", "", ""])
            continue
        versions, git = row.get("versions", {}), row.get("git", {})
        commit = (git.get("commit") or "?")[:12] + (" (dirty)" if git.get("dirty") else "")
        rows.append(
            [
                row["name"],
                _version(row),
                versions.get("torch"),
                versions.get("triton"),
                row["device"].get("device", "?") + (", interpreter" if row["interpreted"] else ""),
                commit,
                row.get("created_utc"),
            ]
        )
    return tabulate(
        rows,
        headers=["implementation", "version", "torch", "triton", "device", "commit", "run (UTC)"],
        tablefmt="github",
    )


def _case_list(row: dict, key: str) -> list[str]:
    lines = []
    for item in row[key]:
        line = item["junit_line"]
        link = f"[{row['junit']}#L{line}]({row['junit']}#L{line})" if line else f"[{row['junit']}]({row['junit']})"
        reason = item["reason"].replace("|", "\\|")
        lines.append(f"- `{item['case']}` ({item['property']}, {item['outcome']}): {reason} — {link}")
    return lines


def _selection(pytest_args: list[str]) -> str:
    """The gate's case selection (``-m``, ``-k``, ``--case``) from the pytest options it recorded."""
    picked = [f"{a} {b!r}" for a, b in itertools.pairwise(pytest_args) if a in ("-m", "-k", "--case")]
    return " ".join(picked)


def render(matrix: dict) -> str:
    env = matrix["environment"]
    machine = env["machine"]
    out = [
        "# Conformance matrix",
        "",
        "Written by `make conformance-matrix` (`python -m pagedbench.conformance.gate.matrix`) from the gate's files "
        "in this folder; nothing here is edited by hand.",
        "",
    ]
    if matrix.get("note"):
        out += [matrix["note"], ""]
    out += [
        LEGEND,
        "",
        _table(matrix),
        "",
        f"Machine: {machine['system']} {machine['arch']}, {machine.get('cpu') or 'unknown CPU'}, "
        f"{machine['cpu_count']} CPUs. Matrix built at commit {(env['git']['commit'] or '?')[:12]} "
        f"({env['created_utc']}).",
        "",
        _environment(matrix),
        "",
    ]
    for row in matrix["implementations"]:
        if row["status"] != "ran":
            continue
        args = _selection(row.get("pytest_args") or [])
        out += [
            f"## {row['name']}",
            "",
            f"Cases: `{row['json']}`, `{row['junit']}`" + (f"; selection `{args}`" if args else "") + ".",
            "",
        ]
        for key, title in (
            ("failures", "Failures"),
            ("crashes", "Crashes"),
            ("bf16_interpreter", "bfloat16 under the interpreter (not counted)"),
        ):
            if row[key]:
                out += [f"{title} ({len(row[key])}):", "", *_case_list(row, key), ""]
        if not (row["failures"] or row["crashes"] or row["bf16_interpreter"]):
            out += ["No failure, crash or bfloat16 miss.", ""]
    return "\n".join(out).rstrip() + "\n"
