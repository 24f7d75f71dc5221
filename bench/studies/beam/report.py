"""The beam study's Markdown report (Figure 15 beside the paper's), rendered from
:func:`bench.studies.beam.study.run_study`'s JSON document; only the paper's numbers are data written by hand
(``beam_study.PAPER``)."""

from __future__ import annotations

from pagedbench.bench.common.environment import environment_markdown
from tabulate import tabulate


def _paper(row: dict, savings: list[dict]) -> str:
    if row["paper_percent"] is not None:
        return f"{row['paper_percent']:.1f}"
    if row["dataset"] == "sharegpt":  # the paper gives ShareGPT as a range over 2..6 only
        lo_hi = [r["paper_percent"] for r in savings
                 if r["dataset"] == "sharegpt" and r["method"] == row["method"] and r["paper_percent"] is not None]
        return f"within {min(lo_hi):.1f}–{max(lo_hi):.1f}" if lo_hi else "–"
    return "–"


def markdown(doc: dict) -> str:
    cfg, savings = doc["config"], doc["savings"]
    rows = [[r["dataset"], r["method"], r["width"], f"{100 * r['saving']:.1f}", _paper(r, savings),
             f"{r['mean_prompt']:.0f} / {r['mean_output']:.0f}"] for r in savings]
    shape = doc["trajectories"]
    shape_rows = [[w, s["num_searches"], s["rounds"],
                   "–" if s["mean_distinct_parents"] is None else f"{s['mean_distinct_parents']:.2f}"]
                  for w, s in shape.items()]
    by = {(r["dataset"], r["method"], r["width"]): r["saving"] for r in savings}
    widths = cfg["widths"]
    lines = [
        "# Memory saved by sharing (the vLLM paper's Figure 15)",
        "",
        "saving = 1 - blocks used with sharing / blocks without sharing, summed over every step of every "
        f"request; each request alone on the real block manager, block size {cfg['block_size']}, "
        f"{cfg['num_requests']} requests per dataset (synthetic Alpaca- and ShareGPT-like lengths, seed "
        f"{cfg['seed']}). Parallel sampling forks the prompt n - 1 times; beam search replays beam "
        f"trajectories recorded from `LLM.beam_search` on the `{cfg['model']}` random model (float32, "
        f"ignore_eos; {cfg['num_trajectories']} Alpaca-like prompts per width, {cfg['trajectory_rounds']} "
        "rounds each, cycled past their end): which beams fork, which are freed, copy-on-write in shared "
        "partial blocks.",
        "",
        tabulate(rows, headers=["dataset", "method", "n / width", "saving %", "paper %",
                                "mean prompt / output"], tablefmt="github"),
        "",
        "Recorded trajectories (mean distinct parents kept per round: 1 = every beam descends from one "
        "beam, width = every beam continues itself):",
        "",
        tabulate(shape_rows, headers=["width", "searches", "rounds", "mean distinct parents"],
                 tablefmt="github"),
        "",
        "## Beside the paper",
        "",
        _comparison(by, widths, shape),
        "",
        environment_markdown(doc["environment"]),
        "",
    ]
    return "\n".join(lines)


def _comparison(by: dict, widths: list[int], shape: dict) -> str:
    def pct(d: str, m: str) -> str:
        return " / ".join(f"{100 * by[(d, m, w)]:.1f}" for w in widths if (d, m, w) in by)

    return "\n".join([
        f"- Alpaca, parallel sampling: ours {pct('alpaca', 'parallel')}% against the paper's 6.1 / 8.5 / "
        "9.8%. Only the prompt is shared, so the saving is the prompt's share of a sample's blocks; "
        "it follows the trace's prompt/output ratio and the block rounding of short prompts (an Alpaca "
        "prompt of ~19 tokens is one or two 16-token blocks).",
        f"- Alpaca, beam search: ours {pct('alpaca', 'beam')}% against 37.6 / 53.1 / 55.2%. Beams share "
        "their common history too, so the saving depends on how often the search collapses onto a few "
        "parents: the paper's came from OPT-13B on real Alpaca prompts; ours from a random tiny model, "
        "whose searches keep on average " + ", ".join(
            f"{s['mean_distinct_parents']:.1f} of {w}" for w, s in shape.items()
            if s["mean_distinct_parents"] is not None)
        + " distinct parents per round (table above): beams that keep collapsing onto a few parents share "
        "most of their history. The paper does not report how its searches branch; if OPT-13B's keep "
        "more distinct parents, that would explain ours saving more. Trajectories recorded from a real "
        "model (SmolLM2) would narrow the gap.",
        f"- ShareGPT: parallel {pct('sharegpt', 'parallel')}% (paper 16.2–30.5%), beam "
        f"{pct('sharegpt', 'beam')}% (paper 44.3–66.3%). Longer prompts make the shared part larger; the "
        "paper's ShareGPT outputs came from the model, ours are synthetic lengths, and its trajectories "
        "are replayed from Alpaca-like searches of the tiny model, cycled over ShareGPT's longer outputs.",
    ])
