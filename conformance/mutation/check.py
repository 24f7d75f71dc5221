"""The mutation check of the real source (``make mutants``): mutants of our kernels, launchers, block
manager, host KV tiers, scheduler, swap preemption, tensor-parallel cut and sampler (the files and
operators: :mod:`conformance.mutation.targets`), each run against the tests that cover its file, reported in
``results/mutation.md`` and ``results/mutation.json``.

``python -m pagedbench.conformance.mutation.check [-j 2] [--max-mutants N] [--per-operator N] [--seed 0]
[--only TEXT] [--out results]``

Why not a general tool: mutmut 3 skips every decorated function (so no ``@triton.jit`` kernel is
mutated) and imports the package from its own copy, which our ``pagedbench.*`` folder mapping defeats;
cosmic-ray rewrites the working tree in place with generic operators. So the operators are ours
(:mod:`conformance.mutation.operators`: exact-span text rewrites, kernels stay valid source) and so is the
runner (:mod:`conformance.mutation.runner`: one private copy of the tree per worker, a timeout per run).

Every mutant runs by default. Sampling is only on request: at most ``--per-operator`` of each (file,
operator), then at most ``--max-mutants`` in all (seeded). The unmutated copy must pass each file's tests
first (its time sets the timeout).
A mutant that survives and is listed in :data:`conformance.mutation.equivalents.EQUIVALENT` is reported
as equivalent, with the reason. A run with ``--only`` (a re-run of some mutants after a test was added)
updates the report already in ``--out``: its rows replace those mutants' rows, the others are kept, and the
report names the commit of each run.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pagedbench.conformance.gate.environment import host_environment
from pagedbench.conformance.mutation import operators as ops
from pagedbench.conformance.mutation.equivalents import equivalence_reason
from pagedbench.conformance.mutation.report import write_report
from pagedbench.conformance.mutation.runner import RunResult, Workspace, run_tests
from pagedbench.conformance.mutation.targets import TARGETS, Target

REPO_ROOT = Path(__file__).resolve().parents[2]
#: pytest options for every run: the suite checks our implementation only
PYTEST_EXTRA = ("--impl", "triton")


def all_mutants(root: Path = REPO_ROOT) -> list[tuple[Target, ops.Mutant]]:
    found = []
    for target in TARGETS:
        chosen = {name: ops.OPERATORS[name] for name in target.operators}
        found += [(target, m) for m in ops.read_mutants(root, target.path, chosen)]
    return found


def sample(mutants: list, *, per_operator: int | None = None, max_mutants: int | None = None, seed: int = 0) -> list:
    """At most ``per_operator`` of each (file, operator), then at most ``max_mutants`` in all, drawn
    round-robin over the (file, operator) groups so every operator keeps its share; seeded, so the same
    tree always gives the same mutants. None: no limit (with neither limit, every mutant). Returned in
    run order (:func:`interleave_files`)."""
    per_operator = len(mutants) if per_operator is None else per_operator
    max_mutants = len(mutants) if max_mutants is None else max_mutants
    groups: dict[tuple[str, str], list] = {}
    for item in mutants:
        groups.setdefault((item[1].path, item[1].operator), []).append(item)
    picked = []
    for key, items in groups.items():
        rng = random.Random(f"{seed}:{key[0]}:{key[1]}")
        picked.append(rng.sample(items, min(per_operator, len(items))))
    chosen = []
    while len(chosen) < max_mutants and any(picked):
        for group in picked:
            if group and len(chosen) < max_mutants:
                chosen.append(group.pop(0))
    return interleave_files(chosen, mutants)


def interleave_files(chosen: list, mutants: list) -> list:
    """``chosen`` in run order: one mutant of each file in turn (each file's in source order), so a run
    stopped early has covered every file alike."""
    order = {id(item): i for i, item in enumerate(mutants)}
    by_file: dict[str, list] = {}
    for item in sorted(chosen, key=lambda item: order[id(item)]):
        by_file.setdefault(item[1].path, []).append(item)
    queues = list(by_file.values())
    out = []
    while any(queues):
        out += [q.pop(0) for q in queues if q]
    return out


@dataclass(frozen=True, slots=True)
class Verdict:
    target: Target
    mutant: ops.Mutant
    result: RunResult
    equivalent: str | None  # the reason, for a survivor known to be equivalent


def run_check(mutants: list, *, jobs: int, timeouts: dict[str, float], log=print, progress=None) -> list[Verdict]:
    """Every mutant in a private workspace (one per worker thread, restored after each run).
    ``progress(verdicts so far)`` is called after each one (under a lock)."""
    local = threading.local()
    workspaces: list[Workspace] = []
    lock = threading.Lock()
    finished: list[Verdict] = []

    def one(item) -> Verdict:
        target, mutant = item
        if not hasattr(local, "ws"):
            local.ws = Workspace(REPO_ROOT)
            with lock:
                workspaces.append(local.ws)
        local.ws.write(mutant.path, mutant.source)
        try:
            result = run_tests(local.ws, target.tests, timeouts[target.path], PYTEST_EXTRA)
        finally:
            local.ws.restore(mutant.path)
        reason = equivalence_reason(mutant) if result.outcome == "survived" else None
        verdict = Verdict(target, mutant, result, reason)
        with lock:
            finished.append(verdict)
            if progress is not None:
                progress(list(finished))
            log(
                f"[{len(finished)}/{len(mutants)}] {result.outcome:8} {result.seconds:5.0f}s {mutant.operator} "
                f"{mutant.location} {result.test}"
            )
        return verdict

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, mutants))
    finally:
        for ws in workspaces:
            ws.remove()


def baselines(targets: list[Target], *, jobs: int, log=print) -> dict[str, RunResult]:
    """Each target's tests on the unmutated copy: they must pass, and their time sets the timeout."""
    ws = Workspace(REPO_ROOT)  # read only here: the runs can share it

    def one(t: Target) -> RunResult:
        r = run_tests(ws, t.tests, 1800, PYTEST_EXTRA)
        log(f"baseline {t.path}: {r.outcome} in {r.seconds:.0f} s")
        return r

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            out = dict(zip((t.path for t in targets), pool.map(one, targets)))
    finally:
        ws.remove()
    for path, r in out.items():
        if r.outcome != "survived":
            raise SystemExit(f"the unmutated tests of {path} do not pass: {r.outcome} {r.test} {r.detail}")
    return out


def earlier_report(out: Path, mutant_ids: set[str]) -> dict | None:
    """The record in ``out/mutation.json`` that a re-run with ``--only`` updates, without the rows of
    mutants today's source no longer makes (None when there is none)."""
    path = out / "mutation.json"
    if not path.exists():
        return None
    rec = json.loads(path.read_text(encoding="utf-8"))
    return {**rec, "mutants": [r for r in rec["mutants"] if r["id"] in mutant_ids]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedbench.conformance.mutation.check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("-j", "--jobs", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--max-mutants", type=int, default=None, help="sample at most this many (default: all)")
    parser.add_argument(
        "--per-operator", type=int, default=None, help="sample at most this many per (file, operator) (default: all)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="only mutants whose file, operator or id contains this text (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="with --only: write a report of this run alone (default: update the report in --out, keeping the "
        "rows of the mutants not re-run)",
    )
    parser.add_argument("--list", action="store_true", help="list the sampled mutants and exit")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    environment = host_environment()  # the commit the mutants are made from, before anything else changes
    found = all_mutants()
    chosen = sample(found, per_operator=args.per_operator, max_mutants=args.max_mutants, seed=args.seed)
    if args.only:
        chosen = [(t, m) for t, m in chosen if any(w in m.mutant_id for w in args.only)]
    if args.list:
        for _, m in chosen:
            print(m.mutant_id)
        return 0
    targets = [t for t in TARGETS if any(t is c[0] for c in chosen)]
    base = baselines(targets, jobs=args.jobs)
    timeouts = {p: max(90.0, 3 * r.seconds) for p, r in base.items()}
    options = {
        "jobs": args.jobs,
        "max_mutants": args.max_mutants,
        "per_operator": args.per_operator,
        "seed": args.seed,
        "only": args.only,
    }

    previous = None if args.fresh or not args.only else earlier_report(args.out, {m.mutant_id for _, m in found})

    def report(verdicts: list[Verdict], complete: bool) -> None:
        # rewritten after every mutant, so a run stopped early still leaves a valid report of what ran
        write_report(
            args.out,
            verdicts,
            files=[t.path for t in TARGETS],
            previous=previous,
            base=base,
            found=len(found),
            planned=len(chosen),
            seconds=time.perf_counter() - start,
            options=options,
            environment=environment,
            complete=complete,
        )

    verdicts = run_check(chosen, jobs=args.jobs, timeouts=timeouts, progress=lambda v: report(v, False))
    report(verdicts, True)
    survivors = [v for v in verdicts if v.result.outcome == "survived" and not v.equivalent]
    print(
        f"mutation check: {len(verdicts) - len(survivors)} of {len(verdicts)} killed or equivalent; "
        f"wrote {args.out / 'mutation.md'}"
    )
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
