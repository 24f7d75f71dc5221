"""Renders the engine-vs-transformers records (results/engine_vs_hf.json) as Markdown."""

from __future__ import annotations

from pathlib import Path

from pagedbench.bench.common import records as result_files
from pagedbench.bench.common.environment import environment_markdown


def result_line(r: dict) -> str:
    c = r["case"]
    if r["status"] != "ok":
        return f"| {c['name']} | {c['model']} | | | | | ≥ {c['goal']:g} | {r['reason']} | |"
    w, e, h = r["workload"], r["engine"], r["transformers"]
    return (f"| {c['name']} | {c['model']} | {w['num_requests']} x {w['prompt_len']} / {w['mean_output_len']:.1f} "
            f"| {e['generated_tokens_per_s']:.1f} | {h['generated_tokens_per_s']:.1f} | **{r['ratio']:.2f}** "
            f"| ≥ {c['goal']:g} | {r['verdict']} | {e['host_share_of_step']:.1%} |")


def markdown(doc: dict) -> str:
    cfg = doc["config"]
    lines = [
        "# Engine vs transformers generate", "",
        f"Greedy, `ignore_eos` in both, {cfg['dtype']}, batch {cfg['batch']}, {cfg['num_threads']} torch threads; "
        "tokens/s counts only the tokens each request asked for. The engine runs with its default settings "
        f"(`max_num_seqs` = {cfg['batch']}); transformers serves static batches of {cfg['batch']}, each "
        "generating up to its longest request (padding steps count as time, not tokens). Engine and "
        "transformers runs alternate; the best run of each side counts (runs per case below). The machine "
        "was shared with other jobs: only the ratios, measured side by side, mean anything.", "",
        "| case | model | requests x prompt / mean output | engine tok/s | transformers tok/s | ratio | goal "
        "| verdict | engine host share of step |",
        "|---|---|---|---|---|---|---|---|---|",
        *(result_line(r) for r in doc["results"]), "",
    ]
    for r in doc["results"]:
        if r["status"] == "ok":
            e, h = r["engine"], r["transformers"]
            lines.append(
                f"- {r['case']['name']}: engine {e['num_steps']} steps ({e['mean_step_ms']:.1f} ms mean), "
                f"{e['wall_s']:.2f} s; transformers {h['wall_s']:.2f} s (best of "
                f"{len(e.get('wall_s_repetitions', [])) or cfg.get('repetitions')} runs each) generating "
                f"{h['padded_tokens']} tokens "
                f"for {h['generated_tokens']} asked; greedy tokens equal to transformers' for "
                f"{r['correctness']['equal_request_share']:.0%} of requests.")
    lines += ["", "host share of step: step wall time minus the model's forward and LM head, over step wall "
              "time (scheduler, block manager, block tables and metadata, the CPU attention backend's gather "
              "layout, sampling).", "",
              environment_markdown(doc["environment"])]
    return "\n".join(lines)


def write_markdown(doc: dict, path: Path) -> str:
    text = markdown(doc)
    result_files.write_text(path, text)
    return text
