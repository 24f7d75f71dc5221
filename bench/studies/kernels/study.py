"""Kernel study: ``paged_decode`` vs ``contiguous_decode`` over batch x context x block size.

For each case the same K/V values sit in a shuffled paged pool and in a contiguous
``[batch, context, kv_heads, head_dim]`` tensor. Both kernels are checked once against
``kernels.reference`` (in float64), then timed with ``triton.testing.do_bench`` (median, after warm-up).
Reported: time, achieved bandwidth (K/V + q + out bytes / time) against a measured device-to-device copy
bandwidth (the physical limit of a memory-bound decode), and the paged/contiguous time ratio.

Without a GPU, timings of the Triton interpreter would mean nothing: the study says so, writes
``results/kernels.json`` with status ``"skipped: no GPU"`` and the environment, and runs one small case
of both kernels against the reference under the interpreter so that the harness itself is exercised.

Run: ``python -m pagedbench.bench --only kernel_study [--full]``
or ``python -m pagedbench.bench kernel_study [--full]``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from pagedbench import kernels
from pagedbench.bench.common import records
from pagedbench.bench.common.environment import RESULTS_DIR, SCHEMA_VERSION, environment, environment_markdown
from pagedbench.bench.common.progress import progress_enabled
from pagedbench.kernels import device, reference
from tabulate import tabulate

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "kernels.yaml"
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}  # relative L2 error vs float64


@dataclass(frozen=True, slots=True)
class Workload:
    batch: int
    context: int  # tokens per sequence
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the decode must read (one copy)."""
        itemsize = torch.empty(0, dtype=self.torch_dtype).element_size()
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * itemsize

    @property
    def moved_bytes(self) -> int:
        """K/V read + q read + out written (block tables and lengths are negligible)."""
        itemsize = torch.empty(0, dtype=self.torch_dtype).element_size()
        return self.kv_bytes + 2 * self.batch * self.num_heads * self.head_dim * itemsize


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """q ``[batch, heads, d]``; paged caches ``[num_blocks, block_size, kv_heads, d]`` with shuffled
    int32 tables ``[batch, blocks_per_seq]``; contiguous k, v ``[batch, context, kv_heads, d]``."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def build_inputs(w: Workload, dev: torch.device, seed: int = 0) -> DecodeInputs:
    """Random K/V (randn), the same values paged through a random permutation of blocks."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    per_seq = math.ceil(w.context / w.block_size)
    shape = (w.batch, per_seq * w.block_size, w.num_kv_heads, w.head_dim)
    k = torch.randn(shape, generator=gen, device=dev).to(w.torch_dtype)
    v = torch.randn(shape, generator=gen, device=dev).to(w.torch_dtype)
    perm = torch.randperm(w.batch * per_seq, generator=gen, device=dev)
    block_tables = perm.view(w.batch, per_seq).to(torch.int32)
    paged = (w.batch * per_seq, w.block_size, w.num_kv_heads, w.head_dim)
    k_cache = torch.empty(paged, dtype=w.torch_dtype, device=dev)
    v_cache = torch.empty_like(k_cache)
    k_cache[perm] = k.view(paged)
    v_cache[perm] = v.view(paged)
    q = torch.randn((w.batch, w.num_heads, w.head_dim), generator=gen, device=dev).to(w.torch_dtype)
    seq_lens = torch.full((w.batch,), w.context, dtype=torch.int32, device=dev)
    return DecodeInputs(q, k_cache, v_cache, block_tables, seq_lens, k[:, : w.context], v[:, : w.context])


def check_correctness(w: Workload, x: DecodeInputs) -> dict[str, object]:
    """Both kernels against the float64 reference: relative L2 errors and the verdict."""
    ref = reference.paged_decode(x.q.double(), x.k_cache.double(), x.v_cache.double(), x.block_tables,
                                 x.seq_lens)
    paged = kernels.paged_decode(x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens)
    contiguous = kernels.contiguous_decode(x.q, x.k, x.v, x.seq_lens)

    def rel(out: torch.Tensor) -> float:
        return float((out.double() - ref).norm() / ref.norm())

    errors = {"paged_rel_err": rel(paged), "contiguous_rel_err": rel(contiguous)}
    tol = TOLERANCE[w.dtype]
    finite = bool(torch.isfinite(paged).all() and torch.isfinite(contiguous).all())
    return {**errors, "tolerance": tol, "finite": finite,
            "passed": finite and all(e <= tol for e in errors.values())}


def copy_bandwidth_gbps(num_bytes: int, warmup_ms: int, rep_ms: int) -> float:
    """A large device-to-device copy: (bytes read + bytes written) / median time."""
    from triton.testing import do_bench

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device.backend().torch_device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def time_case(w: Workload, cfg: dict, copy_gbps: float) -> dict[str, object]:
    """One workload: correctness once, then both kernels timed; a nested result record."""
    from triton.testing import do_bench

    x = build_inputs(w, device.backend().torch_device)
    correct = check_correctness(w, x)
    out = torch.empty_like(x.q)
    runs = {
        "paged": lambda: kernels.paged_decode(x.q, x.k_cache, x.v_cache, x.block_tables, x.seq_lens, out=out),
        "contiguous": lambda: kernels.contiguous_decode(x.q, x.k, x.v, x.seq_lens, out=out),
    }
    timings = {name: do_bench(fn, warmup=cfg["warmup_ms"], rep=cfg["rep_ms"], return_mode="median")
               for name, fn in runs.items()}
    gbps = {name: w.moved_bytes / (ms * 1e-3) / 1e9 for name, ms in timings.items()}
    return {
        "workload": asdict(w),
        "status": "ok" if correct["passed"] else "incorrect",
        "correctness": correct,
        "timings_ms": {name: {"median": ms} for name, ms in timings.items()},
        "derived": {
            "moved_bytes": w.moved_bytes,
            "paged_gbps": gbps["paged"],
            "contiguous_gbps": gbps["contiguous"],
            "paged_share_of_copy_bw": gbps["paged"] / copy_gbps,
            "contiguous_share_of_copy_bw": gbps["contiguous"] / copy_gbps,
            "paged_over_contiguous_time": timings["paged"] / timings["contiguous"],
        },
    }


def workloads(cfg: dict) -> list[Workload]:
    cases = [Workload(b, c, bs, cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["dtype"])
             for b in cfg["batch_sizes"] for c in cfg["context_lens"] for bs in cfg["block_sizes"]]
    return [w for w in cases if w.kv_bytes <= cfg["max_kv_bytes"]]


def run_gpu(cfg: dict) -> dict[str, object]:
    """The timed study (needs a compiled-Triton GPU backend)."""
    from tqdm import tqdm

    copy_gbps = copy_bandwidth_gbps(cfg["copy_bytes"], cfg["warmup_ms"], cfg["rep_ms"])
    bar = tqdm(workloads(cfg), desc="kernel_study", disable=not progress_enabled())
    records = [time_case(w, cfg, copy_gbps) for w in bar]
    reasons = [f"incorrect: {r['workload']}" for r in records if r["status"] != "ok"]
    return {"status": "ok", "copy_bandwidth_gbps": copy_gbps, "records": records,
            "validity": {"valid": not reasons, "reasons": reasons}}


def run_cpu_check(cfg: dict) -> dict[str, object]:
    """No GPU: one untimed case of both kernels (Triton interpreter) against the reference."""
    c = cfg["cpu_check"]
    w = Workload(c["batch"], c["context"], c["block_size"], c["num_heads"], c["num_kv_heads"],
                 c["head_dim"], c["dtype"])
    correct = check_correctness(w, build_inputs(w, torch.device("cpu")))
    reasons = ["no GPU: Triton runs under its interpreter, whose timings say nothing about the kernels"]
    if not correct["passed"]:
        reasons.append("the interpreter correctness check failed")
    return {"status": "skipped: no GPU", "copy_bandwidth_gbps": None, "records": [],
            "interpreter_check": {"workload": asdict(w), "correctness": correct},
            "validity": {"valid": False, "reasons": reasons}}


def render_markdown(result: dict) -> str:
    lines = ["# Kernel study: paged_decode vs contiguous_decode", "",
             environment_markdown(result["environment"])]
    if result["status"] != "ok":
        check = result["interpreter_check"]
        c = check["correctness"]
        lines += [f"**Status: {result['status']}.** No timings: on this machine Triton runs under its "
                  "interpreter, whose timings would say nothing about the kernels. Run `make bench` on a "
                  "CUDA GPU for the table.", "",
                  f"Harness check (interpreter, untimed): {check['workload']} -> paged rel. error "
                  f"{c['paged_rel_err']:.2e}, contiguous {c['contiguous_rel_err']:.2e} (bound "
                  f"{c['tolerance']:.0e}): {'passed' if c['passed'] else 'FAILED'}.", ""]
        return "\n".join(lines)
    rows = []
    for r in result["records"]:
        w, t, d = r["workload"], r["timings_ms"], r["derived"]
        rows.append([w["batch"], w["context"], w["block_size"], f"{t['paged']['median'] * 1e3:.1f}",
                     f"{t['contiguous']['median'] * 1e3:.1f}", f"{d['paged_over_contiguous_time']:.3f}",
                     f"{d['paged_gbps']:.0f}", f"{d['contiguous_gbps']:.0f}",
                     f"{100 * d['paged_share_of_copy_bw']:.0f}%", r["status"]])
    head = ["batch", "context", "block", "paged µs", "contig. µs", "paged/contig.", "paged GB/s",
            "contig. GB/s", "paged % of copy", "status"]
    w0 = result["records"][0]["workload"] if result["records"] else {}
    copy_gbps = result["copy_bandwidth_gbps"]
    lines += [f"Copy bandwidth (device-to-device, read + write): **{copy_gbps:.0f} GB/s**. "
              f"Heads {w0.get('num_heads')}/{w0.get('num_kv_heads')} (q/kv), head_dim {w0.get('head_dim')}, "
              f"{w0.get('dtype')}; medians of `triton.testing.do_bench`.", "",
              tabulate(rows, headers=head, tablefmt="github"), ""]
    if not result["validity"]["valid"]:
        lines += ["**Invalid:** " + "; ".join(result["validity"]["reasons"]), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench kernel_study", description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the `full` sweep of bench/configs/kernels.yaml")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    cfg_all = yaml.safe_load(args.config.read_text())
    cfg = {**cfg_all["full" if args.full else "default"], "cpu_check": cfg_all["cpu_check"]}
    b = device.backend()
    if b.is_gpu and not b.triton_interpret:
        body = run_gpu(cfg)
    else:
        print("kernel_study: no GPU (Triton interpreter) -- skipping timings; "
              "running one untimed correctness check of both kernels instead", flush=True)
        body = run_cpu_check(cfg)
    result = {"schema_version": SCHEMA_VERSION, "study": "kernel_study", "environment": environment(),
              "config": cfg,
              **body}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    records.write_json(args.out_dir / "kernels.json", result)
    markdown = render_markdown(result)
    records.write_text(args.out_dir / "kernels.md", markdown)
    print(markdown)
    if body["status"] == "ok" and not body["validity"]["valid"]:
        raise SystemExit("kernel_study: a kernel disagreed with the reference (see results/kernels.md)")
    if body["status"] != "ok" and not body["interpreter_check"]["correctness"]["passed"]:
        raise SystemExit("kernel_study: the interpreter correctness check failed")


if __name__ == "__main__":
    main(sys.argv[1:])
