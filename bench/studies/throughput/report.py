"""Renders the throughput study's records (results/throughput.json) as Markdown tables and a plot."""

from __future__ import annotations

from pathlib import Path

from pagedbench.bench.common import records
from pagedbench.bench.common.environment import environment_markdown
from tabulate import tabulate

#: the vLLM paper's figures (Kwon et al., SOSP 2023), beside ours for context -- never tuned to match
PAPER = (
    "Paper anchors (OPT-13B, A100-40GB, 15.7K KV slots, max length 2048): vLLM serves 2-4x the request "
    "rate of Orca at the same latency; Figure 13 mean batched requests, ShareGPT @ 2 req/s: Orca Max "
    "7.00 vs vLLM 30.42, Alpaca @ 30 req/s: 7.00 vs 132.44; Figure 2 share of KV memory holding token "
    "states: Orca Max 20.4% vs vLLM 96.3%."
)


#: what paging should buy over contiguous allocation at equal KV memory, in generated tokens/s
PAGED_OVER_CONTIGUOUS_AIM = 2.0


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _allocator_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        w, f, impl = r["workload"], r["figures"], r["implementation"]
        rows.append([
            r.get("model", "-"), w["name"], f"{w['mean_prompt_len']:.1f} / {w['mean_output_len']:.1f}",
            w["num_requests"],
            impl["allocator"] + (" (max)" if impl["contiguous_policy"] else ""),
            f"{f['generated_tokens_per_s']:.1f}", f"{f['requests_per_s']:.2f}", f["peak_running_seqs"],
            f"{f['mean_running_seqs']:.1f} / {f['mean_running_seqs_queued']:.1f}", f["num_preemptions"],
            f"{f['mean_kv_utilisation']:.1%} / {f['mean_kv_utilisation_queued']:.1%}",
            f["num_steps"], _share(f.get("host_share_of_step")), "yes" if r["validity"]["valid"] else "NO",
        ])
    return rows


def paged_over_contiguous(records: list[dict]) -> list[dict]:
    """Per (model, workload) with both allocators: paged / contiguous tokens/s against the aim."""
    by: dict[tuple, dict] = {}
    for r in records:
        by.setdefault((r.get("model"), r["workload"]["name"]), {})[r["implementation"]["allocator"]] = r["figures"]
    out = []
    for (model, name), f in by.items():
        if "paged" in f and "contiguous" in f:
            ratio = f["paged"]["generated_tokens_per_s"] / f["contiguous"]["generated_tokens_per_s"]
            out.append({"model": model, "workload": name, "ratio": ratio, "aim": PAGED_OVER_CONTIGUOUS_AIM,
                        "verdict": "met" if ratio >= PAGED_OVER_CONTIGUOUS_AIM else "not met"})
    return out


def _ratios(records: list[dict]) -> list[str]:
    by: dict[tuple, dict] = {}
    for r in records:
        by.setdefault((r.get("model"), r["workload"]["name"]), {})[r["implementation"]["allocator"]] = r["figures"]
    verdicts = {(v["model"], v["workload"]): v for v in paged_over_contiguous(records)}
    lines = []
    for key, f in by.items():
        if "paged" in f and "contiguous" in f:
            p, c, v = f["paged"], f["contiguous"], verdicts[key]
            lines.append(
                f"- {key[0]} / {key[1]}: paged / contiguous generated tokens/s = "
                f"**{v['ratio']:.2f}x** (aim ≥ {v['aim']:g}x: {v['verdict']}), mean batch "
                f"{p['mean_running_seqs'] / c['mean_running_seqs']:.2f}x, mean KV utilisation "
                f"{p['mean_kv_utilisation']:.1%} vs {c['mean_kv_utilisation']:.1%} (queued steps: "
                f"{p['mean_kv_utilisation_queued']:.1%} vs {c['mean_kv_utilisation_queued']:.1%})")
    return lines


def _prefix_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        f = r["figures"]
        rows.append([
            "on" if r["implementation"]["prefix_caching"] else "off", f"{f['generated_tokens_per_s']:.1f}",
            f"{f['prefix_hit_rate']:.1%}", f"{f['num_computed_tokens'] - f['num_generated_tokens']}",
            f"{f['mean_used_blocks']:.1f}", f"{f['mean_table_blocks']:.1f}", f"{f['sharing_saving']:.1%}",
            f"{f['mean_running_seqs']:.1f}", f["num_preemptions"], "yes" if r["validity"]["valid"] else "NO",
        ])
    return rows


def _split(result: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(allocator comparison, prefix sharing, parallel sampling) records."""
    cfg, records = result["config"], result["records"]
    names = {w["name"] for w in cfg["workloads"]}
    alloc = [r for r in records if r["workload"]["name"] in names]
    prefix = [r for r in records if r["workload"]["name"] == cfg["prefix_sharing"]["name"]]
    parallel = [r for r in records if r["workload"]["name"] == cfg["parallel_sampling"]["name"]]
    return alloc, prefix, parallel


def _parallel_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        f = r["figures"]
        rows.append([
            r["implementation"]["n"], f"{f['generated_tokens_per_s']:.1f}", f"{f['mean_used_blocks']:.1f}",
            f"{f['mean_table_blocks']:.1f}", f"{f['sharing_saving']:.1%}", f"{f['mean_running_seqs']:.1f}",
            f["num_preemptions"], "yes" if r["validity"]["valid"] else "NO",
        ])
    return rows


def write_markdown(result: dict, path: Path) -> str:
    cfg = result["config"]
    alloc, prefix, parallel = _split(result)
    on_cpu = cfg["section"] == "cpu"
    where = (
        f"On the CPU: the {cfg['attention_backend']!r} attention backend and the small random model "
        f"{cfg['model']!r}; trace lengths scaled by each workload's length_scale and max_model_len "
        f"{cfg['max_model_len']} (instead of 2048), so absolute figures are not the paper's. On the CPU "
        "a step costs about in proportion to the tokens in it (the matmuls are compute-bound), so a "
        "larger batch buys little time per token here: "
        "the batch size and KV utilisation that paging wins are what a GPU, where decode is memory-bound, "
        "turns into throughput. Timings come from a shared machine and are noisy."
        if on_cpu else f"On the GPU: the Triton kernels and the {cfg['model']!r} random model.")
    pw = prefix[0]["workload"] if prefix else None
    parts = [
        "# Throughput: paged vs contiguous KV allocation\n",
        f"Same model, same trace (all requests at time 0, greedy, each generating its trace output length), "
        f"same KV memory: {cfg['kv_budget_slots']} token slots, block size {cfg['block_size']}; the "
        f"contiguous baseline reserves max_model_len = {cfg['max_model_len']} slots per request (Orca Max). "
        f"{where} torch threads: {cfg['torch_threads_used']}; tokens/s from the best of "
        f"{cfg.get('repetitions', 1)} repetitions of each run, the runs of a workload alternating.\n",
        "## Paged vs contiguous\n",
        tabulate(_allocator_rows(alloc), headers=[
            "model", "workload", "mean prompt / output", "requests", "allocator", "gen tok/s", "req/s",
            "peak batch", "mean batch (all / queued)", "preemptions", "mean KV util (all / queued)", "steps",
            "host share of step", "same tokens"],
            tablefmt="github"),
        "",
        "all: mean over every step; queued: over the steps that ended with requests still waiting (the "
        "KV pool, not the trace's tail, limits the batch there). host share of step: step wall time less "
        "the model's forward and LM head, over step wall time (scheduler, block manager, block tables and "
        "metadata, the CPU attention backend's gather layout, sampling).",
        "",
        *_ratios(alloc),
        *([f"- smollm2: {cfg['smollm2_status']}"] if cfg.get("smollm2_status", "run") != "run" else []),
        "",
    ]
    if pw:
        parts += [
            f"## Prefix sharing: a {pw['system_prompt_len']}-token system prompt shared by all "
            f"{pw['num_requests']} requests ({pw['dataset']}-like user parts)\n",
            tabulate(_prefix_rows(prefix), headers=[
                "prefix caching", "gen tok/s", "prefix hit rate", "prompt tokens computed",
                "mean blocks held", "mean table entries", "memory saved", "mean batch", "preemptions",
                "same tokens"], tablefmt="github"),
            "",
            "memory saved = 1 - blocks held / block-table entries (a block shared by k tables is held once).",
            "",
        ]
    if parallel:
        w = parallel[0]["workload"]
        parts += [
            f"## Parallel sampling: n completions of each of {w['num_requests']} {w['dataset']}-like prompts "
            f"(length scale {w['length_scale']}; temperature 1, seeded)\n",
            tabulate(_parallel_rows(parallel), headers=[
                "n", "gen tok/s", "mean blocks held", "mean table entries", "memory saved", "mean batch",
                "preemptions", "same tokens"], tablefmt="github"),
            "",
            "same tokens: the children every run has are identical across n (child i's seed is seed + i). "
            "Children share their prompt's blocks only while they run together: a preempted child is "
            "recomputed on its own (prefix caching is off in these runs), so sharing falls when the pool "
            "is full and preempts.",
            "The paper's Figure 15 (Alpaca, block size 16): parallel sampling saves 6.09 / 8.53 / 9.79% "
            "of KV memory at n = 2 / 4 / 6.",
            "",
        ]
    parts += tensor_parallel_section(result)
    parts += [PAPER, "", "## Environment\n", environment_markdown(result["environment"])]
    text = "\n".join(parts)
    records.write_text(path, text)
    return text


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alloc, prefix, parallel = _split(result)
    alloc = [r for r in alloc if r.get("model", result["config"]["model"]) == result["config"]["model"]]
    names = list(dict.fromkeys(r["workload"]["name"] for r in alloc))
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = [("generated_tokens_per_s", "generated tokens/s"),
              ("mean_running_seqs_queued", "mean running batch (queued steps)"),
              ("mean_kv_utilisation_queued", "mean KV utilisation (queued steps)")]
    for ax, (key, label) in zip(axes, panels):
        for k, allocator in enumerate(("paged", "contiguous")):
            vals = [next(r["figures"][key] for r in alloc if r["workload"]["name"] == n
                         and r["implementation"]["allocator"] == allocator) for n in names]
            ax.bar([i + 0.4 * k for i in range(len(names))], vals, width=0.4, label=allocator)
        ax.set_xticks([i + 0.2 for i in range(len(names))], names)
        ax.set_title(label)
    axes[0].legend()
    ax = axes[3]
    shared = [("prefix caching " + ("on" if r["implementation"]["prefix_caching"] else "off"), r)
              for r in prefix] + [(f"n = {r['implementation']['n']}", r) for r in parallel]
    ax.bar(range(len(shared)), [100 * r["figures"]["sharing_saving"] for _, r in shared])
    ax.set_xticks(range(len(shared)), [label for label, _ in shared], rotation=30, ha="right")
    ax.set_title("KV memory saved by sharing (%)")
    fig.suptitle(f"Throughput study ({result['config']['section']}, model {result['config']['model']!r})")
    fig.tight_layout()
    records.save_figure(fig, path, dpi=110)
    plt.close(fig)


def _tp_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        f = r["figures"]
        rows.append([
            r["implementation"]["tensor_parallel_size"], f"{f['generated_tokens_per_s']:.1f}",
            " / ".join(f"{w:.2f}" for w in f["wall_s_repetitions"]), f["num_steps"], f"{f['mean_step_ms']:.1f}",
            _share(f["model_share_of_step"]), _share(f["all_reduce_share_of_step"]),
            f"{f['all_reduces_per_step']:.1f}", " -> ".join(f"{x:.1f}" for x in f["load_avg_1min"]),
            "yes" if r["validity"]["valid"] else "NO",
        ])
    return rows


def tensor_parallel_reading(part: dict) -> str:
    """What the tensor-parallel rows show, in the figures they measured."""
    by = {r["implementation"]["tensor_parallel_size"]: r for r in part["records"]}
    if 1 not in by or 2 not in by:
        return ""
    one, two = by[1]["figures"], by[2]["figures"]
    threads = by[2]["implementation"]["torch_threads_per_rank"]
    cores = part["environment"]["machine"]["cpu_count"]
    loads = one["load_avg_1min"] + two["load_avg_1min"]
    step_ms, reduce_ms = two["mean_step_ms"], two["mean_step_ms"] * two["all_reduce_share_of_step"]
    return (
        f"tp=2 / tp=1 generated tokens/s = **{two['generated_tokens_per_s'] / one['generated_tokens_per_s']:.2f}x**. "
        f"Measured: at tp=2 rank 0's mean step took {step_ms:.1f} ms against {one['mean_step_ms']:.1f} ms at tp=1, "
        f"{reduce_ms:.1f} ms of it ({two['all_reduce_share_of_step']:.0%}) inside its "
        f"{two['all_reduces_per_step']:.0f} all-reduces per step (two per layer: attention out and MLP down "
        "projections; gloo over the loopback, each timed from its call to its return, which includes waiting "
        "for rank 1 to reach it), and its forward and LM head, all-reduces included, took "
        f"{two['model_share_of_step']:.0%} of the step against {one['model_share_of_step']:.0%} at tp=1. "
        f"The machine has {cores} cores and each rank was given {threads} torch thread(s) (OMP_NUM_THREADS), so "
        "tp=2 halves each rank's matmuls but adds the all-reduces and rank 1's step broadcast, and its two "
        "ranks each have a core only when nothing else runs: the 1-minute load average was "
        f"{min(loads):.1f}-{max(loads):.1f} around the best runs (the table: before -> after each)."
    )


def tensor_parallel_section(result: dict) -> list[str]:
    part = result.get("tensor_parallel")
    if not part or not part["records"]:
        return []
    w, g = part["records"][0]["workload"], part["environment"]["git"]
    return [
        f"## Tensor parallelism: tensor_parallel_size 1 and 2, {w['num_requests']} {w['dataset']}-like requests "
        f"(length scale {w['length_scale']}, mean prompt / output {w['mean_prompt_len']:.1f} / "
        f"{w['mean_output_len']:.1f})\n",
        "The same batch from the same model source, the same KV blocks per rank (rank 1 a spawned process "
        "holding half of every layer and of the KV heads), greedy; the sizes alternate, tokens/s from the best "
        "wall time.\n",
        tabulate(_tp_rows(part["records"]), headers=[
            "tp", "gen tok/s", "wall s (each repetition)", "steps", "mean step ms", "rank 0 model share",
            "rank 0 all-reduce share", "all-reduces / step", "load avg 1 min", "same tokens"], tablefmt="github"),
        "",
        tensor_parallel_reading(part),
        "",
        f"Tensor-parallel rows: commit {(g['commit'] or 'unknown')[:12]}{' (dirty)' if g['dirty'] else ''}, "
        f"generated {part['environment']['created_utc']}.",
        "",
    ]
