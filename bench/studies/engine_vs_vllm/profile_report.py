"""``engine_vs_vllm_profile.md``, rendered from the profile's record (nothing measured here)."""

from __future__ import annotations

from pathlib import Path

from pagedbench.bench import records as result_files
from pagedbench.bench.environment import environment_markdown
from pagedbench.bench.studies.engine_vs_vllm.op_categories import CATEGORIES


def _ms_per_token(row: dict, cat: str) -> float:
    return 1e3 * row["seconds"][cat] / row["generated_tokens"]


def gap_rows(ours: dict, theirs: dict) -> list[tuple[str, float, float, float, float | None]]:
    """Per category: (name, ours ms/token, theirs ms/token, ours - theirs, share of the whole gap), largest
    difference first; the share is None where the engines' totals do not differ."""
    total = 1e3 * (ours["wall_s"] / ours["generated_tokens"] - theirs["wall_s"] / theirs["generated_tokens"])
    rows = []
    for cat in CATEGORIES:
        a, b = _ms_per_token(ours, cat), _ms_per_token(theirs, cat)
        rows.append((cat, a, b, a - b, (a - b) / total if total else None))
    return sorted(rows, key=lambda r: -abs(r[3]))


def _status_lines(doc: dict) -> list[str]:
    lines = []
    for row in doc["engines"]:
        if row["status"] != "ok":
            lines.append(f"- {row['engine']}: {row['status']}: {row['reason']}")
            continue
        overhead = row["profiled_wall_s"] / row["plain_wall_s"] - 1
        other = ", ".join(f"`{n}` {1e3 * s:.0f} ms" for n, s in row["top_other"])
        lines.append(f"- {row['engine']} (torch {row['torch']}, {row['threads']} threads): the batch took "
                     f"{row['plain_wall_s']:.2f} s unprofiled ({row['generated_tokens'] / row['plain_wall_s']:.1f} "
                     f"tokens/s) and {row['profiled_wall_s']:.2f} s profiled ({overhead:+.0%}); the ops' self "
                     f"time is {row['ops_s'] / row['wall_s']:.0%} of the profiled wall time. Largest ops: "
                     + ", ".join(f"`{op['name']}` {1e3 * op['self_cpu_s']:.0f} ms" for op in row["top_ops"][:6])
                     + (f"; largest uncategorised: {other}" if other else ""))
    return lines


def gemm_lines(rows: list[dict] | None) -> list[str]:
    if not rows:
        return []
    if rows[0]["status"] != "ok":
        return [f"GEMM paths: {rows[0]['status']}: {rows[0]['reason']}", ""]
    out = ["## The linear layers two ways (this process, the same threads)", "",
           "torch's `F.linear` (the engine's path) against oneDNN with the weight prepacked once (the kind of "
           "path vLLM's `_C::onednn_mm` takes), interleaved, best of 5 rounds; error: max |out - float64| over "
           "max |float64|.", "",
           "| layer | out x in | tokens | F.linear ms | oneDNN prepacked ms | F.linear / oneDNN | errors |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        sec, err = r["seconds"], r["max_rel_error_vs_float64"]
        out.append(f"| {r['layer']} | {r['out_features']} x {r['in_features']} | {r['tokens']} | "
                   f"{1e3 * sec['F.linear']:.2f} | {1e3 * sec['oneDNN prepacked']:.2f} | {r['ratio']:.2f}x | "
                   f"{err['F.linear']:.1e}, {err['oneDNN prepacked']:.1e} |")
    return [*out, ""]


def render(doc: dict) -> str:
    cfg = doc["config"]
    lines = ["# Where the time goes: our engine and vLLM's CPU build on the same batch", "",
             f"{cfg['model']}, {cfg['num_requests']} prompts, {cfg['max_tokens']} greedy tokens each, "
             f"{cfg['dtype']}, {cfg['threads']} threads, prefix caching off; each engine's batch profiled with "
             "torch.profiler (CPU), every op's self time put in one category by its name "
             "(`bench/studies/engine_vs_vllm/op_categories.py`, the same rules for both engines); the host is "
             "the profiled wall time the ops do not cover (Python: scheduling, input preparation, the engine "
             "loop). vLLM's KV gather happens inside its attention op, ours in `index_select`: compare "
             "attention and KV together. Load average (1, 5, 15 min) before: "
             + ", ".join(f"{x:.2f}" for x in doc["load_average"]["before"]) + "; after: "
             + ", ".join(f"{x:.2f}" for x in doc["load_average"]["after"]) + ".", "", *_status_lines(doc), ""]
    ok = {r["engine"]: r for r in doc["engines"] if r["status"] == "ok"}
    if "pagedbench" in ok and "vllm-eager" in ok:
        ours, theirs = ok["pagedbench"], ok["vllm-eager"]
        lines += ["| category | ours ms/token | vLLM eager ms/token | ours − vLLM | share of the gap |",
                  "|---|---|---|---|---|"]
        for cat, a, b, d, share in gap_rows(ours, theirs):
            lines.append(f"| {cat} | {a:.2f} | {b:.2f} | {d:+.2f} | {'–' if share is None else f'{share:.0%}'} |")
        a = 1e3 * ours["wall_s"] / ours["generated_tokens"]
        b = 1e3 * theirs["wall_s"] / theirs["generated_tokens"]
        lines += [f"| **whole batch (profiled)** | {a:.2f} | {b:.2f} | {a - b:+.2f} | 100% |", ""]
    else:
        lines += ["No side-by-side table: both engines must have run.", ""]
    lines += gemm_lines(doc.get("gemm_paths"))
    lines.append(environment_markdown(doc["environment"]))
    return "\n".join(lines) + "\n"


def write_markdown(doc: dict, path: Path) -> str:
    text = render(doc)
    result_files.write_text(path, text)
    return text
