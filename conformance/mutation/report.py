"""``results/mutation.md`` and ``results/mutation.json`` from a mutation check's verdicts, written
atomically, with the machine, versions and commit they came from."""

from __future__ import annotations

from pathlib import Path

from pagedbench.conformance.gate import report_files
from pagedbench.conformance.gate.environment import host_environment

SCHEMA_VERSION = 1
TOOL_FINDING = (
    "mutmut 3 skips every decorated function, so it would mutate none of our `@triton.jit` kernels (and it "
    "imports the package from its own copy, which the `pagedbench.*` folder mapping defeats), and cosmic-ray "
    "mutates the working tree in place with generic operators only: the operators and the runner are ours "
    "(`conformance/mutation/operators.py`, `conformance/mutation/runner.py`)."
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


def score(rows) -> dict[str, int]:
    """Outcome counts of the report's mutant rows."""
    counts = {k: 0 for k in ("killed", "error", "crashed", "timeout", "equivalent", "survived")}
    for r in rows:
        counts[r["outcome"]] += 1
    return counts


def _row(v, commit: str | None) -> dict:
    return {
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
        "commit": commit,
    }


def _runs_of(rec: dict) -> list[dict]:
    """The runs a record was made from (a record written before runs were kept counts as one)."""
    if "runs" in rec:
        return rec["runs"]
    env = rec["environment"]
    return [{"commit": env["git"]["commit"], "created_utc": env["created_utc"], "seconds": rec["seconds"],
             "options": rec["options"], "mutants_run": rec["mutants_run"], "complete": rec["complete"]}]


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
    previous: dict | None = None,
    files: list[str] | None = None,
) -> dict:
    """``environment``: taken when the run started (the tree the mutants came from), else now;
    ``complete`` False: the run was still going (``planned`` mutants, ``len(verdicts)`` of them done).

    ``previous``: an earlier record this run updates (a re-run of some mutants with ``--only``): its rows
    of the mutants run now are replaced, the others kept, each row naming the commit it ran at; the
    record lists every run it holds. Rows are in ``files`` order, then by line (else by path)."""
    environment = environment or host_environment()
    commit = environment["git"]["commit"]
    rows = [_row(v, commit) for v in verdicts]
    planned = len(verdicts) if planned is None else planned
    run = {"commit": commit, "created_utc": environment["created_utc"], "seconds": round(seconds, 1),
           "options": options, "mutants_run": len(verdicts), "complete": complete}
    runs, baselines = [run], {p: {"outcome": r.outcome, "seconds": round(r.seconds, 1)} for p, r in base.items()}
    if previous is not None:
        run_now = {r["id"] for r in rows}
        old_commit = previous["environment"]["git"]["commit"]
        kept = [{**r, "commit": r.get("commit", old_commit)} for r in previous["mutants"] if r["id"] not in run_now]
        rows, planned = kept + rows, len(kept) + planned
        runs = [*_runs_of(previous), run]
        baselines = {**previous["baselines"], **baselines}
        complete = complete and previous["complete"]
    order = {p: i for i, p in enumerate(files or sorted({r["path"] for r in rows}))}
    rows.sort(key=lambda r: (order.get(r["path"], len(order)), r["path"], r["line"], r["id"]))
    return {
        "schema_version": SCHEMA_VERSION,
        "environment": environment,
        "complete": complete,
        "mutants_planned": planned,
        "seconds": round(sum(r["seconds"] for r in runs), 1),
        "options": runs[0]["options"],  # the first run's: the one that chose the mutants
        "runs": runs,
        "mutants_found": found,
        "mutants_run": len(rows),
        "score": score(rows),
        "baselines": baselines,
        "mutants": rows,
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
        f"Written by `make mutants` (`python -m pagedbench.conformance.mutation.check`). {TOOL_FINDING}",
        "",
        f"Commit `{env['git']['commit']}`{' (dirty)' if env['git']['dirty'] else ''}, {env['created_utc']}; "
        f"{env['machine']['cpu']} ({env['machine']['cpu_count']} CPUs); Python {env['versions']['python']}, "
        f"torch {env['versions']['torch']}, triton {env['versions']['triton']} (kernels under the interpreter). "
        f"{total} mutants of {rec['mutants_found']} found (options {rec['options']}), "
        f"in {rec['seconds'] / 60:.1f} min.",
        "",
        *_runs_lines(rec),
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
    first_commit = _runs_of(rec)[0]["commit"]
    for m in rec["mutants"]:
        outcome = "equivalent" if m["equivalent"] else LABELS[m["outcome"]]
        by = "the reason is under Equivalent mutants" if m["equivalent"] else (m["test"] or "-")
        if m["outcome"] in ("crashed", "timeout", "error"):
            by += f" ({m['detail'][:80]})" if m["detail"] else ""
        if m.get("commit") and m["commit"] != first_commit:
            by += f" *re-run* at `{m['commit'][:10]}`"
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


def _runs_lines(rec: dict) -> list[str]:
    """With more than one run (a full run, then re-runs of some mutants with ``--only``): one line each."""
    runs = _runs_of(rec)
    if len(runs) < 2:
        return []
    lines = [f"Made in {len(runs)} runs (each mutant's row is from the last run that ran it):", ""]
    for r in runs:
        only = r["options"].get("only") or []
        what = ("every planned mutant" if not only else f"`--only {' '.join(only)}`" if len(only) <= 3
                else f"{len(only)} `--only` ids, marked *re-run* below")
        lines.append(
            f"- commit `{r['commit'][:10]}`, {r['created_utc']}: {r['mutants_run']} mutants ({what}) in "
            f"{r['seconds'] / 60:.1f} min{'' if r['complete'] else ', stopped early'}"
        )
    return [*lines, ""]


def write_report(out: Path, verdicts, *, base, found: int, seconds: float, options: dict, **kwargs) -> dict:
    """Both files from the verdicts (``kwargs``: ``environment``, ``planned``, ``complete``, ``previous``,
    ``files``, as :func:`record`)."""
    rec = record(verdicts, base=base, found=found, seconds=seconds, options=options, **kwargs)
    report_files.write_json(Path(out) / "mutation.json", rec)
    report_files.write_atomically(Path(out) / "mutation.md", markdown(rec))
    return rec
