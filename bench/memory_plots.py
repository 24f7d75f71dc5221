"""Plots of the memory study (matplotlib, Agg backend), rendered from its JSON document."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from pagedbench.bench import records
from pagedbench.bench.memory_report import POLICIES, baselines, find_run

PARTS = (("token_states", "token states"), ("reserved", "reserved"),
         ("over_reservation", "internal: over-reservation / last-block tail"),
         ("rounding_waste", "internal: buddy rounding"), ("external_fragmentation", "external frag."),
         ("free", "free"))


def _parts(shares: dict) -> dict[str, float]:
    d = dict(shares)
    d["over_reservation"] = d["internal_fragmentation"] - d["rounding_waste"]
    return d


def plot_shares(doc: dict, path: Path) -> None:
    """Stacked shares of the KV pool per allocator, one panel per workload (Figure 2's view)."""
    cfg = doc["config"]
    n = len(cfg["workloads"])
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 4), squeeze=False)
    for ax, w in zip(axes[0], cfg["workloads"]):
        runs = [r for _, r in baselines(doc, w["name"], cfg["step_s"]) if r is not None]
        labels = [r["allocator"]["name"] for r in runs]
        bottom = [0.0] * len(runs)
        for key, label in PARTS:
            vals = [100 * _parts(r["shares"])[key] for r in runs]
            ax.bar(labels, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"{w['name']}, step {cfg['step_s']} s")
        ax.set_ylabel("share of KV memory (%)")
        ax.tick_params(axis="x", rotation=30)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(PARTS), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    records.save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_block_sizes(doc: dict, path: Path) -> None:
    """Paged: token share (top) and mean running requests (bottom) against block size, one line per step
    time, one column per workload."""
    cfg = doc["config"]
    steps = sorted({cfg["step_s"], *cfg["step_sweep_s"]})
    n = len(cfg["workloads"])
    fig, axes = plt.subplots(2, n, figsize=(4.5 * n, 7), squeeze=False)
    for col, w in enumerate(cfg["workloads"]):
        for step in steps:
            pts = [(bs, r) for bs in cfg["block_sizes"]
                   if (r := find_run(doc["runs"], workload=w["name"], step_s=step, kind="paged",
                                     block_size=bs)) is not None]
            sizes = [b for b, _ in pts]
            axes[0][col].plot(sizes, [100 * r["shares"]["token_states"] for _, r in pts], "o-",
                              label=f"step {step:g} s")
            axes[1][col].plot(sizes, [r["mean_running"] for _, r in pts], "o-", label=f"step {step:g} s")
        axes[0][col].set_title(f"paged, {w['name']}")
        for ax, ylabel in ((axes[0][col], "token states (% of KV memory)"),
                           (axes[1][col], "mean running requests")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(cfg["block_sizes"], [str(b) for b in cfg["block_sizes"]])
            ax.minorticks_off()
            ax.set_xlabel("block size (slots)")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)
    fig.tight_layout()
    records.save_figure(fig, path, dpi=110)
    plt.close(fig)


def plot_step_sweep(doc: dict, path: Path) -> None:
    """Mean running requests against the step time (Orca policies and paged bs=16), per workload."""
    cfg = doc["config"]
    steps = sorted({cfg["step_s"], *cfg["step_sweep_s"]})
    n = len(cfg["workloads"])
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 4), squeeze=False)
    for ax, w in zip(axes[0], cfg["workloads"]):
        for key in (*POLICIES, "vllm"):
            ys = [dict(baselines(doc, w["name"], s))[key] for s in steps]
            pts = [(s, r["mean_running"]) for s, r in zip(steps, ys) if r is not None]
            label = "paged bs=16" if key == "vllm" else f"Orca {key}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(steps, [f"{s:g}" for s in steps])
        ax.minorticks_off()
        ax.set_xlabel("step time (s)")
        ax.set_ylabel("mean running requests")
        ax.set_title(w["name"])
        ax.legend(fontsize=7)
    fig.tight_layout()
    records.save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_all(doc: dict, out: Path) -> list[Path]:
    paths = [out / "memory_shares.png", out / "memory_block_size.png", out / "memory_step.png"]
    for fn, p in zip((plot_shares, plot_block_sizes, plot_step_sweep), paths):
        fn(doc, p)
    return paths
