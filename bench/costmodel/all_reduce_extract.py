"""Write ``bench/data/vidur/all_reduce.csv``: Vidur's measured all-reduce times, binned (run once, by hand).

``python -m pagedbench.bench.costmodel.all_reduce_extract <vidur git dir>`` reads, at that checkout's HEAD,
``data/profiling/network/{a100_dgx,h100_dgx}/all_reduce.csv`` and keeps the single-node rows
(``num_workers == devices_per_node``: every GPU of the group in one NVSwitch node, as Vidur's predictor
selects them) for 2, 4 and 8 GPUs. Vidur records ``size`` in bytes (fp16 buffers of ``size / 2``
elements) and ``time_stats.all_reduce.median`` in ms per call (the median over three runs of the median
NCCL kernel time, launch overhead excluded).

Vidur measured ~1,000 sizes per GPU count, 2 KiB to 64 MiB. Below ~1 MiB neighbouring sizes jump between
two levels (on A100 x 4 about 20 and 60 us), so interpolating raw neighbours would make a step's cost
jitter by milliseconds. Each GPU count's rows are therefore binned in quarter octaves of size (a bin
with fewer than :data:`MIN_ROWS_PER_BIN` rows is merged into the next one up) and each bin written as one
row: the geometric mean of its sizes and the median of its times. :mod:`pagedbench.bench.costmodel.all_reduce`
interpolates these rows.
"""

from __future__ import annotations

import csv
import math
import statistics
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data" / "vidur" / "all_reduce.csv"
NETWORKS = ("a100_dgx", "h100_dgx")  # 8-GPU NVSwitch nodes of Vidur's A100 (80 GB) and H100 SKUs
NUM_WORKERS = (2, 4, 8)
BINS_PER_OCTAVE = 4
MIN_ROWS_PER_BIN = 3


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True,
                          text=True).stdout


def binned(points: list[tuple[int, float]]) -> list[tuple[float, float, int]]:
    """``(size_bytes, time_ms)`` rows -> ``(geometric-mean size, median time, rows)`` per quarter octave."""
    bins: dict[int, list[tuple[int, float]]] = {}
    for size, ms in points:
        bins.setdefault(math.floor(math.log2(size) * BINS_PER_OCTAVE), []).append((size, ms))
    out, pending = [], []
    for key in sorted(bins):
        pending += bins[key]
        if len(pending) >= MIN_ROWS_PER_BIN or key == max(bins):
            size = math.exp(statistics.fmean(math.log(s) for s, _ in pending))
            out.append((size, statistics.median(ms for _, ms in pending), len(pending)))
            pending = []
    return out


def main(argv: list[str]) -> None:
    git_dir = argv[0]
    commit = _git(git_dir, "rev-parse", "HEAD").strip()
    rows = []
    for network in NETWORKS:
        path = f"data/profiling/network/{network}/all_reduce.csv"
        records = list(csv.DictReader(_git(git_dir, "cat-file", "-p", f"HEAD:{path}").splitlines()))
        for n in NUM_WORKERS:
            raw = {(int(r["size"]), float(r["time_stats.all_reduce.median"])) for r in records  # drop duplicates
                   if r["collective"] == "all_reduce" and int(r["num_workers"]) == n
                   and int(r["devices_per_node"]) == n}
            for size, ms, count in binned(sorted(raw)):
                rows.append({"network": network, "num_workers": n, "size_bytes": f"{size:.0f}",
                             "time_ms": f"{ms:.4f}", "num_measured_sizes": count})
    with OUT.open("w", newline="") as f:
        f.write(f"# Extracted from github.com/microsoft/vidur at commit {commit} (MIT licence, see README.md),\n"
                "# data/profiling/network/{a100_dgx,h100_dgx}/all_reduce.csv, by"
                " bench/costmodel/all_reduce_extract.py:\n# single-node rows (num_workers == devices_per_node),"
                f" binned in 1/{BINS_PER_OCTAVE} octaves of size: geometric-mean bytes, median of the"
                " median ms per call.\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
