"""This tree's micro-benchmarks against a base commit's, interleaved on one machine in one run.

``python bench/compare.py --base REV`` (``make bench-compare BASE=REV``):

1. checks REV out into a temporary git worktree (A); B is this working tree, uncommitted edits included;
2. makes each importable as ``pagedbench.*`` from a folder of symlinks put first on PYTHONPATH (so an
   installed copy of PagedBench never answers for either), and checks that it does;
3. runs this tree's ``bench/micro`` benchmarks against A and B in alternating rounds (A B, B A, A B...),
   one pytest-benchmark invocation each, so that drift on the machine hits both sides alike;
4. per benchmark, takes each round's fastest time (the least disturbed), and compares the median over
   B's rounds with A's: a ratio beyond the noise band (the larger relative spread, max - min over median,
   of either side's own rounds; at least ``--min-band``) is a regression (exit status 1) or an
   improvement. No figure from any other run is used.
5. states, per benchmark and for the run, the smallest change it could have detected (the band), and
   calls a benchmark "too noisy to judge" when its ratio is inside a band wider than ``--max-band``: on a
   loaded machine the rounds' spread can reach ±40-80%, and "same" would then claim more than was measured.

Both sides run the same benchmark code (this tree's), so only the implementation differs; a benchmark
whose set-up the base cannot run is reported, not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("refengine", "kernels", "conformance", "bench")
MICRO_INI = "[pytest]\nmarkers =\n    micro: micro-benchmarks\npython_files = test_micro_*.py\n"


@dataclass(frozen=True, slots=True)
class Verdict:
    """One benchmark's comparison; times are seconds (the median over rounds of each round's fastest)."""

    name: str
    a_median_s: float | None  # None: the benchmark did not run on A (new, or its set-up failed there)
    b_median_s: float | None  # None: it did not run on B
    ratio: float | None  # B / A: above 1 is slower
    band: float | None  # relative noise band: |ratio - 1| within it is "same"
    verdict: str  # "regressed", "improved", "same", "too noisy to judge", "only on B", "missing on B"


def spread(samples: Sequence[float]) -> float:
    """Relative spread of one side's per-round times: (max - min) / median."""
    return (max(samples) - min(samples)) / statistics.median(samples)


def judge(name: str, a: Sequence[float], b: Sequence[float], *, min_band: float = 0.05,
          max_band: float = 0.2) -> Verdict:
    """Compare one benchmark's per-round times (seconds) on A (base) and B (this tree). A ratio inside a
    band wider than ``max_band`` is "too noisy to judge", not "same"."""
    if not b:
        return Verdict(name, statistics.median(a) if a else None, None, None, None, "missing on B")
    if not a:
        return Verdict(name, None, statistics.median(b), None, None, "only on B")
    a_med, b_med = statistics.median(a), statistics.median(b)
    ratio = b_med / a_med
    band = max(min_band, spread(a), spread(b))
    if ratio > 1 + band:
        verdict = "regressed"
    elif ratio < 1 / (1 + band):
        verdict = "improved"
    elif band > max_band:
        verdict = "too noisy to judge"
    else:
        verdict = "same"
    return Verdict(name, a_med, b_med, ratio, band, verdict)


def judge_all(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]], *,
              min_band: float = 0.05, max_band: float = 0.2) -> list[Verdict]:
    return [judge(n, a.get(n, ()), b.get(n, ()), min_band=min_band, max_band=max_band)
            for n in sorted(set(a) | set(b))]


def detectable(verdicts: Sequence[Verdict], max_band: float) -> str:
    """What this run could have seen: the smallest and the median band over the compared benchmarks, and
    how many were too noisy to judge."""
    bands = sorted(v.band for v in verdicts if v.band is not None)
    if not bands:
        return "no benchmark ran on both sides: nothing could be detected"
    noisy = sum(v.verdict == "too noisy to judge" for v in verdicts)
    line = (f"smallest change this run could detect: ±{bands[0]:.1%} (best benchmark), "
            f"±{statistics.median(bands):.1%} (median over {len(bands)})")
    if noisy:
        line += (f"; {noisy} benchmark(s) too noisy to judge (band above ±{max_band:.0%}): rerun on a quieter "
                 "machine or with more --rounds")
    return line


def failed(verdicts: Sequence[Verdict]) -> bool:
    """A regression, or a benchmark this tree can no longer run, fails the comparison."""
    return any(v.verdict in ("regressed", "missing on B") for v in verdicts)


def round_order(r: int) -> tuple[str, str]:
    """Round ``r`` runs A then B when even, B then A when odd: neither side always goes first."""
    return ("A", "B") if r % 2 == 0 else ("B", "A")


def table(verdicts: Sequence[Verdict]) -> str:
    from tabulate import tabulate

    def us(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e6:,.1f}"

    rows = [[v.name, us(v.a_median_s), us(v.b_median_s), "-" if v.ratio is None else f"{v.ratio:.3f}",
             "-" if v.band is None else f"±{v.band:.1%}", v.verdict] for v in verdicts]
    headers = ["benchmark", "A median (µs)", "B median (µs)", "B/A", "detectable (band)", "verdict"]
    return tabulate(rows, headers=headers, colalign=("left", "right", "right", "right", "right", "left"),
                    disable_numparse=True)


# --- running -----------------------------------------------------------------------------------------
def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def import_root(tree: Path, dest: Path) -> Path:
    """A folder holding ``pagedbench/<pkg>`` symlinks to ``tree``'s top-level packages."""
    pkg = dest / "pagedbench"
    pkg.mkdir(parents=True)
    for name in PACKAGES:
        if (tree / name).is_dir():
            (pkg / name).symlink_to(tree / name, target_is_directory=True)
    return dest


def check_imports(root: Path, env: Mapping[str, str]) -> None:
    code = "import pagedbench.refengine as r; print(r.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    where = proc.stdout.strip()
    if proc.returncode != 0 or not where.startswith(str(root)):
        raise SystemExit(f"error: {root} does not import as pagedbench.refengine (got {where or proc.stderr[-500:]}); "
                         "a commit before the pagedbench namespace layout cannot be compared")


def run_round(micro: Path, ini: Path, root: Path, env: Mapping[str, str], out: Path) -> dict[str, float]:
    """One pytest-benchmark invocation: benchmark name -> its fastest round in seconds, the least disturbed
    by other work on the machine (absent when it failed)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-c", str(ini), "--rootdir", str(micro),
           "--import-mode=importlib", "-p", "no:cacheprovider", "-m", "micro", f"--benchmark-json={out}", str(micro)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"  ({root.name}: pytest exited {proc.returncode})\n{proc.stdout[-2000:]}", file=sys.stderr)
    if not out.is_file():
        return {}
    doc = json.loads(out.read_text())
    return {b["name"]: b["stats"]["min"] for b in doc["benchmarks"]}


def measure(repo: Path, base: str, rounds: int, work: Path) -> tuple[dict, dict]:
    base_tree = work / "base"
    git(repo, "worktree", "add", "--detach", str(base_tree), base)
    try:
        roots = {"A": import_root(base_tree, work / "A"), "B": import_root(repo, work / "B")}
        envs = {}
        for side, root in roots.items():
            envs[side] = {**os.environ, "PYTHONPATH": str(root), "PAGEDBENCH_NO_PROGRESS": "1",
                          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            check_imports(root, envs[side])
        ini = work / "pytest.ini"
        ini.write_text(MICRO_INI)
        samples: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
        for r in range(rounds):
            for side in round_order(r):
                print(f"round {r + 1}/{rounds}: {side}", file=sys.stderr, flush=True)
                medians = run_round(repo / "bench" / "micro", ini, roots[side], envs[side], work / f"{side}{r}.json")
                for name, m in medians.items():
                    samples[side].setdefault(name, []).append(m)
        return samples["A"], samples["B"]
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(base_tree)],
                       capture_output=True, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/compare.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against (A)")
    parser.add_argument("--rounds", type=int, default=5, help="A/B rounds (>= 3; default %(default)s)")
    parser.add_argument("--min-band", type=float, default=0.05,
                        help="smallest relative noise band (default %(default)s)")
    parser.add_argument("--max-band", type=float, default=0.2,
                        help="widest band a 'same' verdict may rest on; wider is 'too noisy to judge' "
                             "(default %(default)s)")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3 to measure a spread; got {args.rounds}")
    repo = Path(git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel"))
    try:
        base = git(repo, "rev-parse", "--verify", f"{args.base}^{{commit}}")
    except subprocess.CalledProcessError:
        parser.error(f"--base {args.base!r} is not a commit of {repo}")
    head = git(repo, "rev-parse", "HEAD")
    dirty = bool(git(repo, "status", "--porcelain", "--untracked-files=no"))
    work = Path(tempfile.mkdtemp(prefix="pagedbench-compare-"))
    try:
        a, b = measure(repo, base, args.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    verdicts = judge_all(a, b, min_band=args.min_band, max_band=args.max_band)
    print(f"A = {args.base} ({base[:12]}), B = this tree ({head[:12]}{', uncommitted changes' if dirty else ''}); "
          f"{args.rounds} interleaved rounds, median over rounds of each round's fastest")
    print(table(verdicts))
    print(detectable(verdicts, args.max_band))
    bad = failed(verdicts)
    print("FAIL: a benchmark regressed beyond its noise band, or no longer runs" if bad else "OK: no regression")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
