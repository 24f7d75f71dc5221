"""The decode kernel's tile sweep: which tiles, warps, pipeline depth and split counts read paged K/V fastest.

``python -m pagedbench.bench.decode_sweep [--out DIR] [--time-limit-s S]`` (a ``make gpu-check`` check).

For each workload every candidate launch plan (:class:`kernels.attention.DecodePlan`: keys per tile,
warps, ``num_stages`` and split count)
is run once against the float64 reference, then timed with ``triton.testing.do_bench``, paged and
contiguous alike, beside the plan :func:`kernels.attention.plan_decode` picks today. What it writes
(``decode_plans.json`` and ``.md``) is the evidence for the launcher's defaults; it changes nothing itself.
A candidate that disagrees with the reference is reported and never ranked. Writes after each workload,
and stops starting candidates at ``--time-limit-s``, so a short loan keeps what it measured.

Without a GPU it refuses (exit status 2): interpreter timings would say nothing.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from pagedbench.bench.common import records
from pagedbench.bench.common.environment import environment, environment_markdown
from pagedbench.bench.studies.kernels import study as kernel_study
from pagedbench.kernels import attention, device, reference
from tabulate import tabulate

#: the workloads swept, each with an equal share of the time limit: the ``kernels`` check's case (2 splits
#: fill the GPU), and a small batch (where splits matter)
WORKLOADS = (kernel_study.Workload(32, 8192, 16, 32, 8, 128, "float16"),
             kernel_study.Workload(4, 8192, 16, 32, 8, 128, "float16"))
# in the order swept, the likeliest first, so that a time limit cuts the least promising plans
STAGES = (3, 4)  # 3 is Triton's default on NVIDIA GPUs
BLOCK_N = (32, 64, 16)
WARPS = (8, 4)
SPLITS = (1, 2, 4, 8)
TOLERANCE = kernel_study.TOLERANCE


@dataclass(frozen=True, slots=True)
class Candidate:
    paged: bool
    plan: attention.DecodePlan

    @property
    def label(self) -> str:
        t = self.plan.tiles
        return f"n{t.block_n} w{t.num_warps} s{t.num_stages} x{self.plan.num_splits}"


def candidates(w: kernel_study.Workload, use_dot: bool) -> list[Candidate]:
    """Every plan swept for ``w``: stages x tiles x warps x splits, each paged beside contiguous, so that a
    cut-off sweep still compares the two layouts."""
    tiles0 = attention.decode_tiles(w.num_heads // w.num_kv_heads, w.head_dim, w.context, False, use_dot)
    out = []
    for stages, block_n, warps, splits in itertools.product(STAGES, BLOCK_N, WARPS, SPLITS):
        tiles = attention.DecodeTiles(tiles0.block_g, block_n, tiles0.block_d, warps, use_dot, stages)
        out += [Candidate(paged, attention.DecodePlan(tiles, splits)) for paged in (True, False)]
    return out


def launch(c: Candidate | None, x: kernel_study.DecodeInputs, w: kernel_study.Workload, out: torch.Tensor,
           paged: bool = True) -> Callable[[], object]:
    """A closure running one decode (``c`` None: the launcher's own plan)."""
    if c is not None:
        paged = c.paged
    k, v = (x.k_cache, x.v_cache) if paged else (x.k, x.v)
    table = x.block_tables if paged else None
    max_context = x.block_tables.shape[1] * w.block_size if paged else x.k.shape[1]
    return lambda: attention._decode(x.q, k, v, table, x.seq_lens, paged=paged,
                                     block_size=w.block_size if paged else 1, scale=None, sliding_window=None,
                                     num_splits=None, out=out, max_context=max_context,
                                     plan=None if c is None else c.plan)


def sweep_workload(w: kernel_study.Workload, cands: list[Candidate], timer: Callable[[Callable], float],
                   deadline: float, dev: torch.device) -> dict:
    """Correctness of every candidate once, then its time (ms); the launcher's own plans timed too."""
    x = kernel_study.build_inputs(w, dev)
    ref = reference.paged_decode(x.q.double(), x.k_cache.double(), x.v_cache.double(), x.block_tables,
                                 x.seq_lens)
    out = torch.empty_like(x.q)
    rows, skipped = [], 0
    for c in cands:
        if time.monotonic() > deadline:
            skipped += 1
            continue
        run = launch(c, x, w, out)
        out.fill_(float("nan"))
        try:
            run()
        except Exception as e:  # a plan the compiler refuses (shared memory, registers) is a finding
            rows.append({"label": c.label, "paged": c.paged, "plan": asdict(c.plan), "error": repr(e)[:300]})
            continue
        err = float((out.double() - ref).norm() / ref.norm())
        ok = bool(torch.isfinite(out).all()) and err <= TOLERANCE[w.dtype]
        row = {"label": c.label, "paged": c.paged, "plan": asdict(c.plan), "rel_err": err, "correct": ok}
        if ok:
            row["ms"] = timer(run)
            row["gbps"] = w.moved_bytes / (row["ms"] * 1e-3) / 1e9
        rows.append(row)
    default = {name: timer(launch(None, x, w, out, paged=name == "paged")) for name in ("paged", "contiguous")}
    return {"workload": asdict(w), "rows": rows, "not_run_past_time_limit": skipped, "default_ms": default}


def best(rows: list[dict], paged: bool) -> dict | None:
    timed = [r for r in rows if r["paged"] == paged and "ms" in r]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def render_markdown(doc: dict) -> str:
    lines = ["# Decode kernel sweep", "", "Generated by `python -m pagedbench.bench.decode_sweep`; do not edit.", "",
             environment_markdown(doc["environment"]), "",
             f"Copy bandwidth (device-to-device, read + write): **{doc['copy_gbps']:.0f} GB/s**. Labels: keys per "
             "tile (n), warps (w), `num_stages` (s), split count (x); `pf` (in runs before it was dropped): the "
             "next tile's block ids loaded one iteration ahead. Medians of `triton.testing.do_bench`.", ""]
    for res in doc["workloads"]:
        w = res["workload"]
        lines += [f"## batch {w['batch']}, context {w['context']}, block {w['block_size']}, heads "
                  f"{w['num_heads']}/{w['num_kv_heads']}, head_dim {w['head_dim']}, {w['dtype']}", ""]
        bp, bc = best(res["rows"], True), best(res["rows"], False)
        d = res["default_ms"]
        table = [["launcher's plan today", f"{d['paged'] * 1e3:.1f}", f"{d['contiguous'] * 1e3:.1f}",
                  f"{d['paged'] / d['contiguous']:.3f}"]]
        if bp and bc:
            table.append([f"best: {bp['label']} / {bc['label']}", f"{bp['ms'] * 1e3:.1f}", f"{bc['ms'] * 1e3:.1f}",
                          f"{bp['ms'] / bc['ms']:.3f}"])
        lines += [tabulate(table, headers=["", "paged µs", "contiguous µs", "paged / contiguous"],
                           tablefmt="github"), ""]
        timed = sorted((r for r in res["rows"] if "ms" in r), key=lambda r: r["ms"])
        top = [[r["label"], "paged" if r["paged"] else "contiguous", f"{r['ms'] * 1e3:.1f}", f"{r['gbps']:.0f}",
                f"{r['gbps'] / doc['copy_gbps']:.0%}"] for r in timed[:12]]
        lines += [tabulate(top, headers=["plan", "layout", "µs", "GB/s", "of copy"], tablefmt="github"), ""]
        bad = [r for r in res["rows"] if not r.get("correct", False)]
        if bad:
            lines += [f"**{len(bad)} plans failed** (error or disagreement with the reference): "
                      + ", ".join(r["label"] + (" paged" if r["paged"] else " contiguous") for r in bad[:20]), ""]
        if res["not_run_past_time_limit"]:
            lines += [f"{res['not_run_past_time_limit']} plans not run: the time limit was reached.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench.decode_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu"), help="output folder (default: %(default)s)")
    parser.add_argument("--time-limit-s", type=float, default=150.0,
                        help="start no candidate after this (shared equally by the workloads)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    b = device.backend()
    if not b.is_gpu or b.triton_interpret:
        print("decode_sweep: no GPU (Triton interpreter): timings would say nothing; nothing swept")
        return 2
    from triton.testing import do_bench

    def timer(fn):
        return do_bench(fn, warmup=5, rep=25, return_mode="median")

    doc = {"environment": environment(), "copy_gbps": kernel_study.copy_bandwidth_gbps(1 << 30, 25, 100),
           "workloads": []}
    for w in WORKLOADS:
        deadline = time.monotonic() + args.time_limit_s / len(WORKLOADS)
        use_dot = attention.decode_uses_dot(w.num_heads // w.num_kv_heads, False, 2)
        doc["workloads"].append(sweep_workload(w, candidates(w, use_dot), timer, deadline, b.torch_device))
        records.write_json(args.out / "decode_plans.json", doc)
        records.write_text(args.out / "decode_plans.md", render_markdown(doc))
    print(render_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
