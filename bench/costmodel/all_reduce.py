"""Measured all-reduce times (``bench/data/vidur/all_reduce.csv``), interpolated by message size.

A tensor-parallel layer ends its attention and its MLP with an all-reduce of the residual stream of
every token in the step (``num_tokens x hidden_size x dtype bytes``). Its time comes from Vidur's NCCL
measurements on 8-GPU NVSwitch nodes (:mod:`pagedbench.bench.costmodel.all_reduce_extract` writes the
table), interpolated linearly in ``log(time)`` against ``log(size)`` between the two rows around a
size. Outside the measured range (about 7 KB to 64 MiB): below it the smallest size's time (an
all-reduce that small is latency, not bytes); above it the largest size's time scaled by size (the
bandwidth-bound regime continued).

Stated assumptions: a hardware profile names the node type its all-reduces ran on
(``HardwareProfile.all_reduce_network``); A100-40GB SXM4 shares the A100-80GB's NVLink 3 / NVSwitch fabric
(600 GB/s), so both use Vidur's ``a100_dgx`` rows; a GPU with no measured node type (L4, H200) has no
tensor-parallel cost and is refused. Kernel times exclude launch overhead (Vidur times NCCL kernels).
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass
from pathlib import Path

ALL_REDUCE_CSV = Path(__file__).resolve().parent.parent / "data" / "vidur" / "all_reduce.csv"


class AllReduceDataError(ValueError):
    """No measured all-reduce for the asked node type and GPU count (the message names what exists)."""


@dataclass(frozen=True, slots=True)
class AllReduceTable:
    """One node type's all-reduce over ``num_workers`` GPUs: ``times_s[i]`` at ``sizes_bytes[i]`` (ascending)."""

    network: str
    num_workers: int
    sizes_bytes: tuple[float, ...]
    times_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sizes_bytes) < 2 or len(self.sizes_bytes) != len(self.times_s):
            raise ValueError(f"an all-reduce table needs >= 2 (size, time) rows of equal count, got "
                             f"{len(self.sizes_bytes)} sizes and {len(self.times_s)} times")
        if any(b <= a for a, b in zip(self.sizes_bytes, self.sizes_bytes[1:])):
            raise ValueError("all-reduce sizes must be strictly ascending")
        if min(self.sizes_bytes) <= 0 or min(self.times_s) <= 0:
            raise ValueError("all-reduce sizes and times must be > 0")

    def time_s(self, size_bytes: float) -> float:
        """Seconds of one all-reduce of ``size_bytes`` (module docstring: log-log between rows)."""
        return interpolate_log_log(self.sizes_bytes, self.times_s, size_bytes)


def interpolate_log_log(sizes: tuple[float, ...], times: tuple[float, ...], size: float) -> float:
    """``times`` at ``size``: linear in log-log between the bracketing rows; the first row's time below
    the table, the last row's scaled by ``size / last size`` above it."""
    if size <= sizes[0]:
        return times[0]
    if size >= sizes[-1]:
        return times[-1] * size / sizes[-1]
    i = bisect.bisect_right(sizes, size)  # sizes[i - 1] <= size < sizes[i]
    x0, x1, y0, y1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
    w = math.log(size / x0) / math.log(x1 / x0)
    return y0 * (y1 / y0) ** w


def _read(path: Path) -> dict[tuple[str, int], list[tuple[float, float]]]:
    with path.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    tables: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in rows:
        tables.setdefault((r["network"], int(r["num_workers"])), []).append(
            (float(r["size_bytes"]), float(r["time_ms"]) * 1e-3))
    return tables


_CACHE: dict[Path, dict[tuple[str, int], list[tuple[float, float]]]] = {}


def load_all_reduce(network: str | None, num_workers: int, path: Path = ALL_REDUCE_CSV) -> AllReduceTable:
    """The measured table of ``network`` (a hardware profile's ``all_reduce_network``) at ``num_workers`` GPUs,
    or :class:`AllReduceDataError` naming the node types and GPU counts that were measured."""
    if path not in _CACHE:
        _CACHE[path] = _read(path)
    tables = _CACHE[path]
    if (network, num_workers) not in tables:
        known = ", ".join(f"{net} x {n}" for net, n in sorted(tables))
        what = "no all-reduce node type (all_reduce_network: none)" if network is None else f"{network!r}"
        raise AllReduceDataError(f"no measured all-reduce for {what} at {num_workers} GPUs in {path.name} "
                                 f"(measured: {known})")
    rows = sorted(tables[network, num_workers])
    return AllReduceTable(network, num_workers, tuple(s for s, _ in rows), tuple(t for _, t in rows))


def networks(path: Path = ALL_REDUCE_CSV) -> list[str]:
    """The node types the table holds."""
    if path not in _CACHE:
        _CACHE[path] = _read(path)
    return sorted({net for net, _ in _CACHE[path]})
