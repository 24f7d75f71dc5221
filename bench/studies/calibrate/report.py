"""The calibration record rendered as Markdown, and both files written atomically.

:func:`write_results` writes ``calibration.json`` and ``calibration.md`` each to a temporary file in the
results folder and moves it into place with ``os.replace``: a reader never sees half a record.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
from pagedbench.bench.common.environment import environment_markdown
from tabulate import tabulate

_TERM_UNITS = {
    "fixed_s": ("fixed (per step)", 1e3, "ms"),
    "linear_compute_s_per_token": ("per token", 1e6, "µs"),
    "lm_head_s_per_sampled_token": ("per sampled sequence", 1e6, "µs"),
    "decode_attn_s_per_context_token": ("per decode context token", 1e9, "ns"),
    "prefill_attn_s_per_pair": ("per prefill (query, key) pair", 1e9, "ns"),
    "attn_group_s": ("per attention group", 1e6, "µs"),
    "decode_attn_s_per_padded_key": ("per padded decode key", 1e9, "ns"),
    "prefill_attn_s_per_padded_pair": ("per padded prefill (query, key) pair", 1e9, "ns"),
    "prefill_group_s": ("per prefill group (beyond a decode group's)", 1e6, "µs"),
}


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or its old content, never a part: temp file in its folder, then replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the results from other readers
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_results(record: dict, out: Path, name: str = "calibration") -> tuple[Path, Path]:
    """``out/name.json`` and ``out/name.md``, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    write_atomic(json_path, json.dumps(record, indent=2) + "\n")
    write_atomic(md_path, render_markdown(record))
    return json_path, md_path


def _pct(x: float) -> str:
    return f"{x:+.1%}" if x < 0 else f"{x:.1%}"


def _fit_tables(cal: dict) -> list[str]:
    linear = cal.get("linear_terms", {}).get("coefficients", {})
    ident = cal.get("identifiability", {})
    coef = [(label, f"{cal['coefficients'][t] * scale:.4g} {unit}",
             f"{ident[t]:.3f}" if t in ident else "-", f"{linear[t] * scale:.4g} {unit}" if t in linear else "-")
            for t, (label, scale, unit) in _TERM_UNITS.items() if t in cal["coefficients"]]
    rows = []
    for kind, s in cal["fit_errors"].items():
        if s["num_samples"]:
            rows.append((kind, s["num_samples"], _pct(s["median_abs"]), _pct(s["p90_abs"]), _pct(s["max_abs"]),
                         _pct(s["rms"]), _pct(s["median_signed"])))
    base = cal["constant_baseline"]
    b = base["errors"]
    rows.append((f"constant {base['step_s'] * 1e3:.2f} ms (baseline)", b["num_samples"], _pct(b["median_abs"]),
                 _pct(b["p90_abs"]), _pct(b["max_abs"]), _pct(b["rms"]), _pct(b["median_signed"])))
    return [
        f"## Calibration: {cal['num_samples']} timed steps in {cal['wall_s']:.1f} s",
        "", f"Steps by kind: {cal['num_samples_by_kind']}; decode batches up to {cal['max_decode_batch']}; "
            f"host (scheduler) share of a step, median: {cal['host_share_median']:.1%}; CPU time / wall time "
            f"of the steps: {cal['cpu_share_of_wall']:.1%}.", "",
        tabulate(coef, ["term", "fitted cost", "identifiability", "linear terms only (for comparison)"],
                 tablefmt="github"), "",
        "Identifiability: the share (0..1) of a term's column in the fit (relative weighting) that no combination "
        "of the other terms explains over the grid's steps; near 0 the grid cannot tell the term from the "
        "others and its fitted value is arbitrary.", "",
        "Relative error of the fit on its own samples (predicted / measured - 1):", "",
        tabulate(rows, ["steps", "n", "median abs err", "p90 abs err", "max abs err", "rms", "median (signed)"],
                 tablefmt="github"), "",
    ]


def _wake_table(wake: dict | None) -> list[str]:
    if not wake:
        return []
    rows = []
    pickup = wake.get("pickup_s") or [None] * len(wake["gaps_s"])
    for gap, extra, pairs, p in zip(wake["gaps_s"], wake["extra_s"], wake["pairs"], pickup):
        warm = [float(np.median([w for w, _ in step])) for step in pairs]
        rows.append((f"{gap * 1e3:.0f} ms", len(pairs[0]), "-" if p is None else f"{p * 1e3:.2f} ms",
                     *(f"{e * 1e3:+.2f} ms ({w * 1e3:.2f})" for e, w in zip(extra, warm))))
    steps = ["prefill" if i == 0 else f"decode {i}" for i in range(len(wake["extra_s"][0]))]
    return [
        "## Waking an idle engine", "",
        "A lone prompt's first steps (its prefill, then decodes) right after the previous request (warm) and "
        "after an idle wait (the loop sleeping, as between arrivals): the median extra time of each step over "
        "its pairs (in brackets: the warm step's median), and the loop's median pick-up (the arrival it slept "
        "until to the start of its step: the sleep's overshoot, queueing the request, planning the step). The "
        "online check charges these after each idle wait (interpolated between the waits).", "",
        tabulate(rows, ["idle wait", "pairs", "pick-up", *(f"{s}: extra (warm)" for s in steps)],
                 tablefmt="github"), "",
    ]


def _floor_line(floor: dict | None) -> list[str]:
    if not floor:
        return []
    return ["Steps the aftermath would have taken below "
            f"{floor['wall']['min_steady_share']:.0%} of their measured time (noise: a median over other steps "
            "larger than this one), held there for the fit: " + ", ".join(
                f"{f['num_clipped']} of {f['num_samples']} ({clock} clock)" for clock, f in floor.items()) + ".", ""]


def _after_prefill_table(after: dict | None, floor: dict | None = None) -> list[str]:
    if not after:
        return []
    rows = []
    for batch, row, pair_row in zip(after["batches"], after["extra_s"], after["pairs"]):
        for tokens, extra, pairs in zip(after["prefill_tokens"], row, pair_row):
            steady = float(np.median([s for s, _ in pairs[0]]))
            rows.append((batch, tokens, len(pairs[0]), f"{steady * 1e3:.2f} ms", *(f"{e * 1e3:+.2f}" for e in extra)))
    return [
        "## What a prefill costs the decode steps after it", "",
        "Decode batches that a prompt joins every few steps (for one step): the median extra time (ms) of each of "
        "the first decode steps after the join, against the same stretch's later steps (its steady state). The "
        "batched fits are made on the grid's steps less these, and the simulator charges them after each prefill "
        "(interpolated in the prefill's tokens from 0 and in the batch).", "",
        tabulate(rows, ["decoding sequences", "prefill tokens", "joins", "steady step",
                        *(f"decode {i + 1}" for i in range(len(after["extra_s"][0][0])))], tablefmt="github"), "",
        *_floor_line(floor),
    ]


def _validation_tables(v: dict, cal_cpu_share: float, name: str) -> list[str]:
    lat, sched, mk = v["latency"], v["schedule"], v["makespan"]
    t = v["trace"]
    rows = [("per-request latency, median abs err", "", "", _pct(lat["median_abs_rel_error"]),
             _pct(lat["real_spread_median"]))]
    for q in v["quantiles"]:
        rows.append((f"latency p{round(q['quantile'] * 100)}", f"{q['real_a_s']:.3f} / {q['real_b_s']:.3f}",
                     f"{q['sim_s']:.3f}", _pct(q["rel_error"]), _pct(q["real_spread"])))
    rows.append(("makespan", f"{mk['real_a_s']:.3f} / {mk['real_b_s']:.3f}", f"{mk['sim_s']:.3f}",
                 _pct(mk["rel_error"]), _pct(mk["real_spread"])))
    s = v["step_error"]
    verdict = "met" if lat["goal_met"] else "NOT met"
    return [
        f"## Validation: {t['num_requests']} {t['dataset']}-like requests at t=0 (mean prompt "
        f"{t['mean_prompt_len']:.0f}, mean output {t['mean_output_len']:.0f} tokens), {v['wall_s']:.1f} s", "",
        f"Schedule: steps {sched['num_steps']}, identical step shapes: {sched['same_steps']}; the two real "
        f"runs generated the same tokens: {sched['same_tokens_in_real_runs']}.", "",
        tabulate(rows, ["", "real run a / b (s)", "simulated (s)", "sim error", "real-run spread"],
                 tablefmt="github"), "",
        f"Goal: median per-request error <= max({v['trace']['goal_floor']:.0%}, "
        f"{v['trace']['goal_spread_factor']} x spread {lat['real_spread_median']:.1%}) = {lat['goal']:.1%}: "
        f"**{verdict}** ({_pct(lat['median_abs_rel_error'])}; signed median {_pct(lat['median_signed_rel_error'])}, "
        f"p90 |err| {_pct(lat['p90_abs_rel_error'])}).", "",
        f"The fitted model on the trace's {s['num_samples']} real steps (out of sample): median |err| "
        f"{_pct(s['median_abs'])}, p90 {_pct(s['p90_abs'])}, signed median {_pct(s['median_signed'])}. "
        f"Share of the real makespan inside engine steps: "
        f"{', '.join(f'{x:.1%}' for x in mk['share_inside_steps'])}; CPU time / wall time of the steps: "
        f"{', '.join(f'{x:.1%}' for x in mk['cpu_share_of_wall'])} (calibration: {cal_cpu_share:.1%}).", "",
        "This trace arrives at once (an offline batch). The same model checked online, under Poisson arrivals "
        "in real time at a low rate and near saturation (TTFT, TPOT and E2E per percentile, KS statistics): "
        f"[{name}_online.md]({name}_online.md), written by `calibrate_online` from this file.", "",
    ]


def _variants_table(record: dict) -> list[str]:
    cal, v = record["calibration"], record["validation"]
    variants = (("wall clock, the fitted terms (the result)", cal, v),
                ("wall clock, fit rescaled to median error 0", cal["median_rescaled"], v["median_rescaled"]),
                ("CPU time (process_time), the same terms", cal["cpu_clock"], v["cpu_clock"]))
    if "without_after_prefill" in cal:
        variants += (("wall clock, the same terms fitted and charged without a prefill's cost to the decode "
                      "steps after it", cal["without_after_prefill"], v["without_after_prefill"]),)
    if "linear_terms" in cal:
        variants += (("wall clock, the linear terms only (the old fit)", cal["linear_terms"], v["linear_terms"]),)
    rows = []
    for name, fit, val in variants:
        lat, errors = val["latency"], fit["fit_errors"]["all"]
        rows.append((name, _pct(errors["median_abs"]), _pct(errors["median_signed"]),
                     _pct(val["step_error"]["median_signed"]), _pct(lat["median_abs_rel_error"]),
                     _pct(lat["median_signed_rel_error"]), _pct(lat["real_spread_median"]), f"{lat['goal']:.1%}",
                     "yes" if lat["goal_met"] else "NO", _pct(val["makespan"]["rel_error"])))
    return [
        "## The model's error and the machine's noise", "",
        "The same grid and trace, timed on two clocks: the wall clock (what a user waits) and this process's "
        "CPU time (the time a step held a core; most of the other workers' contention taken out).", "",
        tabulate(rows, ["", "fit: median abs err", "fit: median signed", "trace steps: median signed",
                        "latency: median abs err", "latency: median signed", "real-run spread", "goal", "met",
                        "makespan err"], tablefmt="github"), "",
    ]


def _since_prefill_table(record: dict) -> list[str]:
    cal, v = record["calibration"], record["validation"]
    grid, trace = cal.get("decode_since_prefill"), v.get("decode_since_prefill")
    if not grid or not trace:  # a record written before this diagnostic
        return []
    plain_grid = cal.get("without_after_prefill", {}).get("decode_since_prefill") or [None] * len(grid)
    plain_trace = v.get("without_after_prefill", {}).get("decode_since_prefill") or [None] * len(trace)

    def error(row: dict | None) -> str:
        return "-" if row is None or not row["num_steps"] else _pct(row["median_signed"])

    def step(row: dict) -> str:
        return "-" if not row["num_steps"] else f"{row['median_step_s'] * 1e3:.2f} ms"

    rows = [(g["since_prefill"], g["num_steps"], step(g), error(g), error(pg), t["num_steps"], step(t), error(t),
             error(pt)) for g, t, pg, pt in zip(grid, trace, plain_grid, plain_trace)]
    return [
        "## Decode steps by their distance from a prefill", "",
        "The model's signed error (predicted / measured - 1) on decode-only steps, by how many decode steps have "
        "run since the last step with a prefill chunk (1: the step right after it): on the grid (its samples) "
        "and on the validation trace's two real runs (out of sample); with the cost a prefill leaves to the "
        "decode steps after it (the result) and with the same terms fitted without it. Priced by its shape "
        "alone, a step's error trends down the rows when its cost depends on what ran before it: the grid's "
        "decode stretches are short (a prompt joins every few steps), an offline batch's tail and a lightly "
        "loaded server's are long.", "",
        tabulate(rows, ["decode steps since a prefill", "grid: steps", "grid: median step", "grid: error",
                        "grid: error without", "trace: steps", "trace: median step", "trace: error",
                        "trace: error without"], tablefmt="github"), "",
    ]


def render_markdown(record: dict) -> str:
    load = record["machine_load"]
    validity = record["validity"]
    lines = [
        "# Step-cost calibration of the CPU engine" + (" (quick)" if record["config"]["quick"] else ""), "",
        environment_markdown(record["environment"]).rstrip(),
        f"- model: {record['config']['engine']['model']} ({record['config']['engine']['dtype']}, "
        f"{record['config']['engine']['attention_backend']} attention), torch threads "
        f"{record['config']['torch_threads_used']}",
        f"- load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load['loadavg_before'])}; "
        f"after: {', '.join(f'{x:.2f}' for x in load['loadavg_after'])} on {load['cpu_count']} cores", "",
        f"**Valid: {validity['valid']}**" + "".join(f"\n- {r}" for r in validity["reasons"]), "",
        *_fit_tables(record["calibration"]),
        *_wake_table(record["calibration"].get("wake")),
        *_after_prefill_table(record["calibration"].get("after_prefill"),
                              record["calibration"].get("after_prefill_floor")),
        *_validation_tables(record["validation"], record["calibration"]["cpu_share_of_wall"],
                            record.get("results_name", "calibration")),
        *_variants_table(record),
        *_since_prefill_table(record),
        "## Assumptions", "", *(f"- {a}" for a in record["assumptions"]), "",
    ]
    return "\n".join(lines)
