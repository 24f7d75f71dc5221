"""Plots of the serving study: one figure per setting (``results/serving_<setting>.png``).

Each panel is a dataset: normalized latency (the paper's Fig. 12 metric) against the offered rate, one
colour per KV manager, one line style per scheduler policy, seed 0's points; overloaded points (no
latency is reported for them) are marked with an x on a line above the curves; the first threshold is a labelled
line. The paper's Fig. 12 ratios appear only on the panel they were measured on.
"""

from __future__ import annotations

import re
from pathlib import Path

from pagedbench.bench.common import records

PAPER_PANEL = ("opt-13b@a100-40gb", "sharegpt")
PAPER_TEXT = "paper (paged / Orca):\nOracle 1.7–2.7×, Max 2.7–8×"
STYLES = {"mixed": "-", "separate": "--"}


def plot_names(doc: dict) -> dict[str, str]:
    """Setting name -> its plot's file name."""
    return {s["name"]: f"serving_{re.sub(r'[^a-z0-9]+', '_', s['name'].lower()).strip('_')}.png"
            for s in doc["config"]["settings"]}


def plot(doc: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threshold = doc["config"]["thresholds"][0]
    base = [s for s in doc["searches"] if not s["cost_scale"] and s["seed"] == min(doc["config"]["seeds"])]
    colours = {}
    for setting, file in plot_names(doc).items():
        rows = [s for s in base if s["setting"] == setting]
        datasets = sorted({s["dataset"] for s in rows})
        if not datasets:
            continue
        fig, axes = plt.subplots(1, len(datasets), figsize=(6.4 * len(datasets), 5.2), squeeze=False,
                                 layout="constrained")
        for ax, dataset in zip(axes[0], datasets):
            searches = sorted((s for s in rows if s["dataset"] == dataset), key=lambda s: (s["allocator"], s["policy"]))
            lats = [p["normalized_latency_s"] for s in searches for p in s["points"] if not p["overloaded"]]
            top = 1.5 * max(lats)  # overloaded points (no latency reported) are drawn on this line
            for s in searches:
                colour = colours.setdefault(s["allocator"], f"C{len(colours)}")
                pts = sorted(s["points"], key=lambda p: p["rate"])
                ok = [p for p in pts if not p["overloaded"]]
                ax.plot([p["rate"] for p in ok], [p["normalized_latency_s"] for p in ok], marker="o", ms=3,
                        ls=STYLES.get(s["policy"], ":"), color=colour, label=f"{s['allocator']}, {s['policy']}")
                over = [p["rate"] for p in pts if p["overloaded"]]
                ax.plot(over, [top] * len(over), "x", color=colour)
            low = min(s["low_load_normalized_latency_s"] for s in searches)
            ax.axhline(threshold * low, color="grey", ls=":", lw=1)
            ax.text(0.02, threshold * low, f"{threshold:g}× low-load latency", transform=ax.get_yaxis_transform(),
                    fontsize=8, color="grey", va="bottom")
            ax.axhline(top, color="lightgrey", lw=0.5)
            ax.text(0.02, top, "x: overloaded (no latency)", transform=ax.get_yaxis_transform(), fontsize=8,
                    color="grey", va="bottom")
            if (setting, dataset) == PAPER_PANEL:
                ax.text(0.02, 0.6, PAPER_TEXT, transform=ax.transAxes, fontsize=8, color="grey", va="top")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{setting}, {dataset} (curves that coincide are drawn over each other)", fontsize=9)
            ax.set_xlabel("offered request rate (req/s)")
            ax.set_ylabel("normalized latency (s/token)")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, 0.95))
        records.save_figure(fig, Path(out) / file, dpi=100)
        plt.close(fig)
