"""Plots of the memory study (matplotlib, Agg backend), rendered from its JSON document."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from pagedbench.bench.common import records
from pagedbench.bench.studies.memory.report import find_run


def plot_block_sizes(doc: dict, path: Path) -> None:
    """Paged: token share (top) and mean running requests (bottom) against block size, one column per
    workload (step times from the cost model)."""
    cfg = doc["config"]
    n = len(cfg["workloads"])
    fig, axes = plt.subplots(2, n, figsize=(4.5 * n, 7), squeeze=False)
    for col, w in enumerate(cfg["workloads"]):
        pts = [(bs, r) for bs in cfg["block_sizes"]
               if (r := find_run(doc["runs"], workload=w["name"], kind="paged", block_size=bs)) is not None]
        sizes = [b for b, _ in pts]
        axes[0][col].plot(sizes, [100 * r["shares"]["token_states"] for _, r in pts], "o-")
        axes[1][col].plot(sizes, [r["mean_running"] for _, r in pts], "o-")
        axes[0][col].set_title(f"paged, {w['name']}")
        for ax, ylabel in ((axes[0][col], "token states (% of KV memory)"),
                           (axes[1][col], "mean running requests")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(cfg["block_sizes"], [str(b) for b in cfg["block_sizes"]])
            ax.minorticks_off()
            ax.set_xlabel("block size (slots)")
            ax.set_ylabel(ylabel)
    fig.tight_layout()
    records.save_figure(fig, path, dpi=110)
    plt.close(fig)


def plot_all(doc: dict, out: Path) -> list[Path]:
    path = out / "memory_block_size.png"
    plot_block_sizes(doc, path)
    return [path]
