"""``results/mutation.md`` and ``results/mutation.json`` from a mutation check's verdicts, written
atomically, with the machine, versions and commit they came from."""

from __future__ import annotations

from pathlib import Path

from pagedbench.conformance import report_files
from pagedbench.conformance.gate_environment import host_environment

SCHEMA_VERSION = 1
TOOL_FINDING = (
    "mutmut 3 skips every decorated function, so it would mutate none of our `@triton.jit` kernels (and it "
    "imports the package from its own copy, which the `pagedbench.*` folder mapping defeats), and cosmic-ray "
    "mutates the working tree in place with generic operators only: the operators and the runner are ours "
    "(`conformance/mutation_operators.py`, `conformance/mutation_runner.py`)."
)
LABELS = {
    "killed": "killed (assertion)",
    "error": "killed (exception)",
    "crashed": "crashed",
    "timeout": "timeout",
    "survived": "SURVIVED",
}


def outcome_of(verdict) -> str:
    return "equivalent" if verdict.equivalent else verdict.result.outcome


def score(verdicts) -> dict[str, int]:
    counts = {k: 0 for k in ("killed", "error", "crashed", "timeout", "equivalent", "survived")}
    for v in verdicts:
        counts[outcome_of(v)] += 1
    return counts


def record(
    verdicts,
    *,
    base,
    found: int,
    seconds: float,
    options: dict,
    environment: dict | None = None,
    planned: int | None = None,
    complete: bool = True,
) -> dict:
    """``environment``: taken when the run started (the tree the mutants came from), else now;
    ``complete`` False: the run was still going (``planned`` mutants, ``len(verdicts)`` of them done)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "environment": environment or host_environment(),
        "complete": complete,
        "mutants_planned": len(verdicts) if planned is None else planned,
        "seconds": round(seconds, 1),
        "options": options,
        "mutants_found": found,
        "mutants_run": len(verdicts),
        "score": score(verdicts),
        "baselines": {p: {"outcome": r.outcome, "seconds": round(r.seconds, 1)} for p, r in base.items()},
        "mutants": [
            {
                "id": v.mutant.mutant_id,
                "operator": v.mutant.operator,
                "path": v.mutant.path,
                "line": v.mutant.line,
                "function": v.mutant.function,
                "original": v.mutant.original,
                "mutated": v.mutant.mutated,
                "tests": list(v.target.tests),
                "outcome": outcome_of(v),
                "test": v.result.test,
                "detail": v.result.detail,
                "seconds": round(v.result.seconds, 1),
                "equivalent": v.equivalent,
            }
            for v in verdicts
        ],
    }


def _code(text: str, width: int = 70) -> str:
    text = " ".join(text.split())
    text = text if len(text) <= width else text[: width - 1] + "…"
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def markdown(rec: dict) -> str:
    env, s = rec["environment"], rec["score"]
    total = rec["mutants_run"]
    killed = s["killed"] + s["error"] + s["crashed"] + s["timeout"]
    lines = [
        "# Mutation check of the real source",
        "",
        f"Written by `make mutants` (`python -m pagedbench.conformance.mutation_check`). {TOOL_FINDING}",
        "",
        f"Commit `{env['git']['commit']}`{' (dirty)' if env['git']['dirty'] else ''}, {env['created_utc']}; "
        f"{env['machine']['cpu']} ({env['machine']['cpu_count']} CPUs); Python {env['versions']['python']}, "
        f"torch {env['versions']['torch']}, triton {env['versions']['triton']} (kernels under the interpreter). "
        f"{total} mutants of {rec['mutants_found']} found (options {rec['options']}), "
        f"in {rec['seconds'] / 60:.1f} min.",
        "",
        *(
            []
            if rec["complete"]
            else [f"**Partial: the run was stopped after {total} of its {rec['mutants_planned']} mutants.**", ""]
        ),
        f"**Score: {killed} of {total} killed** — {s['killed']} by an assertion, {s['error']} by an exception, "
        f"{s['crashed']} by a crash, {s['timeout']} by a timeout; {s['equivalent']} equivalent (explained below); "
        f"{s['survived']} survived.",
        "",
        "| operator | location | original → mutated | outcome | by |",
        "|---|---|---|---|---|",
    ]
    for m in rec["mutants"]:
        outcome = "equivalent" if m["equivalent"] else LABELS[m["outcome"]]
        by = m["test"] or "-"
        if m["outcome"] in ("crashed", "timeout", "error"):
            by += f" ({m['detail'][:80]})" if m["detail"] else ""
        lines.append(
            f"| {m['operator']} | {m['path']}:{m['line']} `{m['function']}` | {_code(m['original'], 50)} → "
            f"{_code(m['mutated'], 50)} | {outcome} | {by.replace('|', '/')} |"
        )
    equivalent = [m for m in rec["mutants"] if m["equivalent"]]
    if equivalent:
        lines += ["", "## Equivalent mutants", ""]
        lines += [
            f"- {m['operator']} at {m['path']}:{m['line']} ({_code(m['mutated'], 60)}): {m['equivalent']}"
            for m in equivalent
        ]
    lines += ["", "## Tests run per file (the unmutated copy's time)", ""]
    lines += [f"- `{p}`: {b['seconds']:.0f} s" for p, b in rec["baselines"].items()]
    return "\n".join(lines) + "\n"


def write_report(out: Path, verdicts, *, base, found: int, seconds: float, options: dict, **kwargs) -> dict:
    """Both files from the verdicts (``kwargs``: ``environment``, ``planned``, ``complete``, as :func:`record`)."""
    rec = record(verdicts, base=base, found=found, seconds=seconds, options=options, **kwargs)
    report_files.write_json(Path(out) / "mutation.json", rec)
    report_files.write_atomically(Path(out) / "mutation.md", markdown(rec))
    return rec
