"""``findings.md``: each finding's reproduction run, shown with its source, what it printed and the peer lines
it cites, and a summary by suite family (``conformance.peers.findings`` holds the findings themselves), with
the float64 reference the reproductions compare against."""

from __future__ import annotations

import contextlib
import inspect
import io
import platform
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from pagedbench.conformance.gate.environment import environment
from pagedbench.conformance.peers import _package_dir, version_of


def attend(q, k, v, scale):
    """Float64 reference for one decode query: q [heads, d]; k, v [n, kv_heads, d] (n may be 0: gives 0)."""
    import torch

    q, k, v = q.double(), k.double(), v.double()
    if k.shape[0] == 0:
        return torch.zeros_like(q)
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [n, heads, d]
    p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", p, v)


@dataclass(frozen=True, slots=True)
class Finding:
    """One finding: a title, whether it is a bug, what it means, its reproduction (which returns whether the
    finding still shows on the installed peers), the peer lines it cites and the suite families whose
    cases show it."""

    title: str
    kind: str  # "bug" or "limitation"
    found_on: str  # the peer versions the finding was first reported on
    summary: str
    reproduce: Callable[[], bool]
    cites: tuple[tuple[str, str], ...] = ()  # (installed file relative to site-packages, text on the line)
    families: tuple[str, ...] = ()  # suite files whose cases show it, e.g. "test_decode.py"


@dataclass(frozen=True, slots=True)
class FamilyReview:
    """A suite family whose peer results were read for findings, with what the page should say beside them
    (the peers it cannot judge and why, what their adapters refuse)."""

    family: str  # the suite file, e.g. "test_fp8_kv.py"
    note: str = ""


def _cite(relative: str, text: str) -> str:
    """The installed peer file's line containing ``text``, with its number."""
    top, _, rest = relative.partition("/")
    path = _package_dir(top) / rest
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if text in line:
            return f"- `{relative}:{number}`: `{line.strip()}`"
    return f"- `{relative}`: (no line containing `{text}` in the installed file)"


def _run(fn: Callable[[], bool]) -> tuple[str, bool | None]:
    """(what the reproduction printed, whether the finding showed; None when the reproduction raised)."""
    buffer = io.StringIO()
    shows = None
    with contextlib.redirect_stdout(buffer):
        try:
            shows = bool(fn())
        except Exception:  # a reproduction that raises shows the traceback as its output
            buffer.write(traceback.format_exc(limit=3))
    return buffer.getvalue().rstrip(), shows


def _status(shows: bool | None, versions: str) -> str:
    if shows is None:
        return f"could not be re-checked on {versions}: the reproduction raised (its output below)"
    return f"still reproduces on {versions}" if shows else f"fixed: does not reproduce on {versions}"


def _short_status(shows: bool | None) -> str:
    return {True: "still reproduces", False: "fixed", None: "could not be re-checked"}[shows]


def family_lines(
    findings: tuple[Finding, ...], shows: list[bool | None], reviews: tuple[FamilyReview, ...]
) -> list[str]:
    """One line per reviewed family and per other family a finding names, in that order: the numbers of
    the findings its cases show (with each one's status), or "none found"; then the family's note."""
    families = list(dict.fromkeys([r.family for r in reviews] + [f for x in findings for f in x.families]))
    notes = {r.family: r.note for r in reviews}
    lines = []
    for family in families:
        found = [
            f"{n} ({_short_status(s)})"
            for n, (x, s) in enumerate(zip(findings, shows), start=1)
            if family in x.families
        ]
        said = ("finding " if len(found) == 1 else "findings ") + ", ".join(found) if found else "none found"
        note = notes.get(family, "")
        lines.append(f"- `{family}`: {said}." + (f" {note}" if note else ""))
    return lines


def _finding_section(number: int, finding: Finding, printed: str, status: str) -> list[str]:
    out = [
        f"## {number}. {finding.title} ({finding.kind})",
        "",
        f"**Status:** {status}; found on {finding.found_on}.",
        "",
        finding.summary,
        "",
    ]
    if finding.cites:
        out += ["Where:", "", *(_cite(rel, text) for rel, text in finding.cites), ""]
    source = inspect.getsource(finding.reproduce).rstrip()
    return [*out, "```python", source, "```", "", "Output:", "", "```", printed, "```", ""]


def render(findings: tuple[Finding, ...], reviews: tuple[FamilyReview, ...]) -> str:
    """The page: a header naming the versions it ran on and :func:`attend` (the float64 oracle the
    reproductions use), the findings' statuses, a summary by family, then each finding in full."""
    import torch
    import triton

    versions = (
        f"vllm {version_of('vllm')}, sglang {version_of('sglang')}, torch {torch.__version__}, "
        f"triton {triton.__version__}, Python {platform.python_version()}"
    )
    git = environment(None)["git"]
    commit = f"{git['commit'] or '?'}" + (" (dirty)" if git["dirty"] else "")
    interpreted = "on the CPU under Triton's interpreter" if not torch.cuda.is_available() else "on the GPU"
    out = [
        "# Findings in the outside kernels",
        "",
        "Written by `python -m pagedbench.conformance.peers.findings` (`make conformance-matrix`): each "
        "reproduction below was run as shown, " + interpreted + f", with {versions}; the output is what it "
        f"printed (pagedbench commit {commit}). Argument validation (none of these kernels checks its "
        "arguments) is in the matrix's validation column; bfloat16 misses under the interpreter are not findings.",
        "",
        "```python",
        inspect.getsource(attend).rstrip(),
        "```",
        "",
    ]
    peers = f"vllm {version_of('vllm')}, sglang {version_of('sglang')}"
    runs = [_run(finding.reproduce) for finding in findings]
    shows = [s for _, s in runs]
    tally = [f"{sum(s is True for s in shows)} still reproducing", f"{sum(s is False for s in shows)} fixed"]
    if any(s is None for s in shows):
        tally.append(f"{sum(s is None for s in shows)} could not be re-checked")
    out += [f"Re-checked on {peers}: " + ", ".join(tally) + ".", ""]
    out += [
        f"- {number}. {finding.title}: {_status(s, peers)} (found on {finding.found_on})"
        for number, (finding, s) in enumerate(zip(findings, shows), start=1)
    ]
    out += [
        "",
        "## By suite family",
        "",
        "The families whose peer results were read for findings, and the families the findings come from: "
        "the findings each one's cases show, or none found.",
        "",
        *family_lines(findings, shows, reviews),
        "",
    ]
    for number, (finding, (printed, s)) in enumerate(zip(findings, runs), start=1):
        out += _finding_section(number, finding, printed, _status(s, peers))
    return "\n".join(out).rstrip() + "\n"
