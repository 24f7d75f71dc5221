"""``results/calibration_online.md``: the online check's record as Markdown."""

from __future__ import annotations

from pagedbench.bench.common.environment import environment_markdown

_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2E"}


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _step_line(e: dict | None) -> list[str]:
    if not e:
        return []
    return [f"The fitted model on the real runs' own {e['num_steps']} steps: median error "
            f"{_pct(e['median_rel_error'])} (absolute {e['median_abs_rel_error']:.1%}; "
            + ", ".join(f"{k.replace('_', ' ')} {'-' if v is None else _pct(v)}"
                        for k, v in e.get("median_rel_error_by_kind", {}).items())
            + f"; {e.get('num_steps_with_prefill', '?')} steps with a prefill"
            + ("" if e.get("num_steps_after_idle") is None else f", {e['num_steps_after_idle']} waking an idle engine")
            + "); predicted / measured step "
            f"time in all: {e['predicted_over_measured_total']:.3f}.", ""]


def _wake_note(wake: dict | None) -> str:
    if not wake:
        return ", no cost of waking an idle engine (the record predates its measurement)"
    extras = ", ".join(f"{sum(e) * 1e3:+.1f} ms after {g * 1e3:.0f} ms"
                       for g, e in zip(wake["gaps_s"], wake["extra_s"]))
    pickup = wake.get("pickup_s")
    picked = (f", and the loop's pick-up of the arrival: {', '.join(f'{p * 1e3:.2f} ms' for p in pickup)}"
              if pickup else "")
    return (f", plus waking an idle engine: {extras} idle, over the first {len(wake['extra_s'][0])} steps after "
            f"a wait{picked}")


def _after_prefill_note(after: dict | None) -> str:
    if not after:
        return ", no cost of a prefill to the decode steps after it (the record predates its measurement)"
    first = [[row[i][0] for i in range(len(after["prefill_tokens"]))] for row in after["extra_s"]]
    largest = max(after["prefill_tokens"])
    per_batch = ", ".join(f"{row[-1] * 1e3:+.2f} ms at {b} decoding" for b, row in zip(after["batches"], first))
    return (f", plus what a prefill costs the first {len(after['extra_s'][0][0])} decode steps after it (measured "
            f"apart from the fit, which was made on the steps less it; the first decode step after {largest} "
            f"prefilled tokens: {per_batch})")


def _rate_section(r: dict) -> list[str]:
    lines = [f"### {r['name'].replace('_', ' ')}: {r['rate_per_s']:.2f} requests/s "
             f"({r['fraction_of_saturation']:.0%} of saturation), last arrival at {r['last_arrival_s']:.1f} s", "",
             "Share of a core the real runs got while busy (CPU time / wall time with work in the engine; the "
             "calibration's steps ran at about 1.0): " + ", ".join(
                 "-" if x is None else f"{x:.2f}" for x in r.get("real_cpu_share_while_busy", [])), "",
             *_step_line(r.get("step_error")), *_metrics_table(r["metrics"])]
    return [*lines, ""]


def _metrics_table(metrics: dict) -> list[str]:
    lines = ["| metric | median per-request error | real runs' spread | goal | met | p50 error (spread) | "
             "p90 error (spread) | p99 error (spread) | KS sim-a / sim-b | KS a-b |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in metrics.items():
        q = " | ".join(f"{_pct(x['rel_error'])} ({x['real_spread']:.1%})" for x in m["quantiles"])
        ks = m["ks"]
        lines.append(f"| {_NAMES[name]} | {m['median_abs_rel_error']:.1%} (signed {_pct(m['median_signed_rel_error'])})"
                     f" | {m['real_spread_median']:.1%} | {m['goal']:.1%} | {'yes' if m['goal_met'] else 'NO'} | {q} | "
                     f"{ks['sim_vs_real_a']:.2f} / {ks['sim_vs_real_b']:.2f} | {ks['real_a_vs_real_b']:.2f} |")
    return lines


def _in_process_section(record: dict) -> list[str]:
    """The same comparison with the grid refit in the check's own process (absent with --no-refit)."""
    if not record.get("in_process_fit"):
        return []
    met = sum(m["goal_met"] for r in record["rates"] for m in r["in_process_fit"]["metrics"].values())
    lines = ["## The same check with the grid refit in this process", "",
             "The calibration grid measured again in this process just before the real runs, fitted the same "
             f"way ({record['in_process_fit']['label']}): the machine's speed as the runs saw it. **Goal "
             f"{'met' if record['goal_met_in_process_fit'] else 'NOT met'}** for {met} of {_count(record, None)} "
             "metrics x rates. Where it meets the goal and the published model does not, the difference is the "
             "machine's drift between the calibration's session and this one, not the model's form.", ""]
    for r in record["rates"]:
        lines += [f"### {r['name'].replace('_', ' ')}", "", *_step_line(r["in_process_fit"]["step_error"]),
                  *_metrics_table(r["in_process_fit"]["metrics"]), ""]
    return lines


def _count(record: dict, flag: str | None) -> int:
    """How many (rate, metric) sections have ``flag`` true (None: how many there are)."""
    return sum(flag is None or bool(m.get(flag)) for r in record["rates"] for m in r["metrics"].values())


def _fit_used_line(record: dict) -> list[str]:
    used = record.get("fit_used")
    if not used:
        return []
    if used["refit"]:
        return [f"**Fit checked: refitted in this session**, not the published one: {used['reason']}. The "
                "calibration grid was measured and fitted here before the real runs; every error below is "
                "against that fit.", ""]
    return [f"**Fit checked: the published one** ({used['reason']}).", ""]


def render_markdown(record: dict) -> str:
    c, load = record["config"], record["machine_load"]
    lines = [
        "# The simulator checked online: calibrated step-cost model vs the real CPU engine", "",
        *_fit_used_line(record),
        f"Engine: `{c['engine']['model']}` model, `{c['engine']['attention_backend']}` attention, "
        f"{c['engine']['dtype']}; cost model: {c['cost_model']['label']} ("
        + ("refitted here; published: " if (record.get("fit_used") or {}).get("refit") else "from ")
        + f"`{c['calibration']}`)"
        + _wake_note(c.get("wake")) + _after_prefill_note(c.get("after_prefill")) + ".",
        f"Trace: {c['num_requests']} ShareGPT-like requests (lengths x {c['length_scale']}: mean prompt "
        f"{c['mean_prompt_len']:.0f}, mean output {c['mean_output_len']:.0f} tokens), Poisson arrivals (seed "
        f"{c['arrival_seed']}). Saturation rate (the fitted model, the trace as one offline batch): "
        f"{record['saturation_rate_per_s']:.1f} requests/s.",
        f"Each rate: the real engine twice on the wall clock (requests queued as their arrival time passes), the "
        f"simulator once on the same arrivals. Errors are the simulator's against the mean of the two real runs; "
        f"the spread is |a - b| / mean of the real runs. Goal per metric: median per-request error <= "
        f"max({c['goal_floor']:.0%}, {c['goal_spread_factor']} x the spread).", "",
        f"**Goal {'met' if record['goal_met'] else 'NOT met'}** (met for {_count(record, 'goal_met')} of "
        f"{_count(record, None)} metrics x rates; median of their median errors: "
        f"{record['median_abs_rel_error_all']:.1%}). Against the "
        f"{c['goal_floor']:.0%} floor alone (the goal without the spread's allowance): met for "
        f"{_count(record, 'floor_met')} of {_count(record, None)}. A wide real-run spread (a loaded machine) "
        "widens the goal: read the errors beside the spread and the cores' share below.", "",
        f"Run: {record['run_wall_s']:.0f} s of wall time; load average before {load['loadavg_before'][0]:.2f}, "
        f"after {load['loadavg_after'][0]:.2f} on {load['cpu_count']} CPUs.", "",
    ]
    for r in record["rates"]:
        lines += _rate_section(r)
    lines += _in_process_section(record)
    lines += ["KS: the two-sample Kolmogorov-Smirnov statistic (largest gap between empirical CDFs); the real runs' "
              "own KS is the noise floor it is read against. TPOT leaves out one-token outputs.", "",
              "Steps that wake an idle engine (the loop had waited for an arrival: at a low rate, many requests' "
              "first step) run slower than the same shape in a busy run (while the loop slept, other processes "
              "used the caches the weights were in). A step's shape cannot say it; the simulator knows when its "
              "clock jumped over an idle wait, and adds the calibration's measured cost of waking after a wait "
              "that long to the next steps (the step errors above include it for those steps). Compare the "
              "errors of the steps with a prefill after idle and while busy above.", "",
              environment_markdown(record["environment"]), ""]
    return "\n".join(lines)
