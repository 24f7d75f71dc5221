"""``make gpu-check``: the checks only a GPU can run, as one prepared script for a short loan of one.

It installs nothing (``make gpu-check`` runs at most ``pip install --no-deps --no-build-isolation -e .``),
runs on whatever torch / triton / cupy the machine has, writes each check's record to ``results/gpu/``
as soon as the check ends (a loan that runs out keeps what finished), prints one verdict line per check
and keeps to a time budget (default 240 s; a check that would start past it is skipped, said so):

1. ``gate``: the compiled Triton kernels and our block manager through the conformance gate (fast grid);
2. ``kernels``: paged decode timed with ``triton.testing.do_bench`` against the measured device copy
   bandwidth at >= 256 MB of KV, paged / contiguous time, and beside torch's SDPA (and FlashAttention or
   FlashInfer when installed). Goals: paged >= 85% of copy bandwidth, paged / contiguous <= 1.05;
3. ``decode_sweep``: the decode kernel's plans (tiles, warps, pipeline depth, splits)
   timed paged and contiguous (``bench.studies.kernels.decode_sweep``), the evidence for the launcher's defaults;
4. ``engine``: tokens/s of the engine on a Llama-shaped bf16 model (``medium`` in
   ``bench/configs/models.yaml``) with CuPy block memory, paged and contiguous, then each step of the same
   batch split into attention, the rest of the forward and the host (``bench.common.step_breakdown``);
5. ``calibration``: the step-time calibration of the serving study's cost model on this GPU;
6. ``families``: the compiled kernels on the suite's ``slow`` grids of large blocks (256, 512) and long
   contexts (to 32K), and of GQA groups 12 and 16 (fp16 cases: a GPU path the interpreter cannot reach),
   the attention-state merge with cascade cases, and the steps of engine runs (prefix hits, chunked prefill,
   forks, preemption) with the metadata our scheduler built (see :data:`FAMILY_ARGS`).

Without a GPU it refuses, exit status 2, having checked nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHECKS = ("gate", "kernels", "decode_sweep", "engine", "calibration", "families")
DEFAULT_OUT = Path("results/gpu")
KV_BYTES_GOAL = 256 << 20
GOALS = {"paged_share_of_copy_bw": 0.85, "paged_over_contiguous_time": 1.05}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="time budget in seconds (default: 240)")
    parser.add_argument("--only", action="append", choices=CHECKS, help="run only this check (repeatable)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    return args


def gpu_present() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU here (torch.cuda.is_available() is False)"
    return True, torch.cuda.get_device_name(0)


#: parallel workers of the gate and of the families' pytest: compiling the kernels' variants (and the
#: prefill autotuner's configs) for every shape class dominates on a GPU, and compiling is per CPU core
JOBS = max(1, min(12, (os.cpu_count() or 2) - 2))


def _run_logged(cmd: list[str], log: Path, timeout_s: float, cwd: Path | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` with its output streamed to ``log`` (what a check killed at its limit had printed stays
    readable); (exit status or None when killed at ``timeout_s``, the log's tail)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = None
    tail = log.read_text(errors="replace")[-3000:]
    return returncode, tail + (f"\n[killed at its {timeout_s:g} s limit]" if returncode is None else "")


def check_gate(out: Path) -> dict:
    cmd = [sys.executable, "-m", "pagedbench.conformance", "--impl", "triton", "--jobs", str(JOBS), "--out",
           str(out / "conformance")]
    returncode, tail = _run_logged(cmd, out / "gate.log", 170)
    summary_path = out / "conformance" / "triton.json"
    counts = json.loads(summary_path.read_text())["counts"] if summary_path.exists() else {}
    summary = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no summary written"
    if returncode is None:
        summary += " (killed at its time limit; see gate.log)"
    return {"passed": returncode == 0, "counts": counts, "tail": tail, "summary": summary}


def _sdpa_ms(w, x) -> float:
    """torch's SDPA on the same K/V laid out contiguously (what a non-paged framework would run)."""
    import torch
    from triton.testing import do_bench

    group = w.num_heads // w.num_kv_heads
    q = x.q.unsqueeze(2)  # [b, h, 1, d]
    k = x.k.transpose(1, 2).repeat_interleave(group, dim=1)  # [b, h, ctx, d]
    v = x.v.transpose(1, 2).repeat_interleave(group, dim=1)
    return do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), warmup=25, rep=100,
                    return_mode="median")


def check_kernels(out: Path) -> dict:
    from pagedbench.bench.studies.kernels import study as kernel_study

    cfg = {"warmup_ms": 25, "rep_ms": 100}
    copy_gbps = kernel_study.copy_bandwidth_gbps(1 << 30, 25, 100)
    w = kernel_study.Workload(32, 8192, 16, 32, 8, 128, "float16")  # 1 GiB of K and V
    assert w.kv_bytes >= KV_BYTES_GOAL
    record = kernel_study.time_case(w, cfg, copy_gbps)
    x = kernel_study.build_inputs(w, kernel_study.device.backend().torch_device)
    record["timings_ms"]["torch_sdpa_contiguous"] = {"median": _sdpa_ms(w, x)}
    record["peers_installed"] = {name: importlib.util.find_spec(name) is not None
                                 for name in ("flash_attn", "flashinfer")}
    d = record["derived"]
    met = {k: (d[k] >= goal if k.startswith("paged_share") else d[k] <= goal) for k, goal in GOALS.items()}
    record["goals"] = {k: {"goal": GOALS[k], "measured": d[k], "met": met[k]} for k in GOALS}
    record["copy_bandwidth_gbps"] = copy_gbps
    return {**record, "passed": record["status"] == "ok" and all(met.values()),
            "summary": f"paged {d['paged_gbps']:.0f} GB/s = {d['paged_share_of_copy_bw']:.0%} of copy "
                       f"({copy_gbps:.0f} GB/s), paged/contiguous {d['paged_over_contiguous_time']:.3f}, "
                       f"SDPA {record['timings_ms']['torch_sdpa_contiguous']['median']:.3f} ms"}


def check_engine(out: Path) -> dict:
    import torch
    from pagedbench.bench.common import step_breakdown
    from pagedbench.refengine import LLM, ModelConfig, SamplingParams

    cfg_path = Path(__file__).resolve().parent / "configs" / "models.yaml"
    config = ModelConfig.from_yaml(cfg_path, name="medium")
    prompts = [[(7 * i + j) % config.vocab_size for j in range(64 + 8 * (i % 8))] for i in range(64)]
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    rows, split = {}, {}
    for allocator in ("paged", "contiguous"):
        llm = LLM(config, dtype="bfloat16", allocator=allocator, kv_cache_memory=8 << 30, max_num_seqs=64,
                  max_num_batched_tokens=4096, max_model_len=1024)
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows[allocator] = {"seconds": seconds, "output_tokens_per_s": len(prompts) * params.max_tokens / seconds,
                           "kv_memory": type(llm.pool.arrays(0)[0]).__module__}
        # the same batch again, each step split into attention / rest of forward / host: where a gap lies
        split[allocator] = step_breakdown.measure(llm, prompts, params, cuda=True)
        rows[allocator]["breakdown"] = split[allocator].as_dict()
    ratio = rows["paged"]["output_tokens_per_s"] / rows["contiguous"]["output_tokens_per_s"]
    lines = "; ".join(f"{a}: {b.line()}" for a, b in split.items())
    return {"rows": rows, "paged_over_contiguous_tokens_per_s": ratio, "passed": True,
            "summary": f"paged {rows['paged']['output_tokens_per_s']:.0f} tok/s "
                       f"({rows['paged']['kv_memory']} memory), contiguous "
                       f"{rows['contiguous']['output_tokens_per_s']:.0f} tok/s, ratio {ratio:.2f}; {lines}"}


def check_calibration(out: Path) -> dict:
    if importlib.util.find_spec("pagedbench.bench.studies.calibrate.study") is None:
        return {"passed": None, "summary": "skipped: this version has no calibration study"}
    cmd = [sys.executable, "-m", "pagedbench.bench.studies.calibrate.study", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return {"passed": run.returncode == 0, "tail": run.stdout[-1500:] + run.stderr[-1500:],
            "summary": "calibrated, see calibration.md" if run.returncode == 0 else "calibration failed"}


#: the suite modules and case filters of the ``families`` check (--case: any of these in the test id)
FAMILY_ARGS = ("conformance/suite/test_long_context.py", "conformance/suite/test_gqa_groups.py",
               "conformance/suite/test_merge_states.py", "conformance/suite/test_engine_metadata.py", "-m",
               "not micro", "--case", "fp16", "--case", "test_merge_states")


def check_families(out: Path) -> dict:
    from pagedbench.conformance.gate.runner import SUITE_PYTEST_ARGS

    root = Path(__file__).resolve().parents[1]
    xml = (out / "families.xml").resolve()
    xdist = ["-n", str(JOBS)] if importlib.util.find_spec("xdist") is not None else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITE_PYTEST_ARGS, "--impl", "triton",
           *xdist, *FAMILY_ARGS, f"--junitxml={xml}"]
    returncode, tail = _run_logged(cmd, out / "families.log", 180, cwd=root)
    last = ([line for line in tail.strip().splitlines() if line.strip()] or ["no output"])[-1]
    return {"passed": returncode == 0, "tail": tail, "summary": last}


def check_decode_sweep(out: Path) -> dict:
    cmd = [sys.executable, "-m", "pagedbench.bench.studies.kernels.decode_sweep", "--out", str(out),
           "--time-limit-s", "80"]
    returncode, tail = _run_logged(cmd, out / "decode_sweep.log", 160)
    sweep = out / "decode_plans.json"
    if returncode != 0 or not sweep.exists():
        return {"passed": False, "tail": tail, "summary": "sweep failed; see decode_sweep.log"}
    from pagedbench.bench.studies.kernels import decode_sweep

    parts = []
    for res in json.loads(sweep.read_text())["workloads"]:
        bp, bc, d = decode_sweep.best(res["rows"], True), decode_sweep.best(res["rows"], False), res["default_ms"]
        w = res["workload"]
        parts.append(f"batch {w['batch']}: today {d['paged'] / d['contiguous']:.2f}x contiguous"
                     + (f", best paged {bp['label']} {bp['ms'] / bc['ms']:.2f}x best contiguous" if bp and bc else ""))
    failed = sum(1 for res in json.loads(sweep.read_text())["workloads"] for r in res["rows"]
                 if not r.get("correct", False))
    return {"passed": failed == 0, "summary": "; ".join(parts) + (f"; {failed} plans failed" if failed else "")}


RUNNERS = {"gate": check_gate, "kernels": check_kernels, "decode_sweep": check_decode_sweep, "engine": check_engine,
           "calibration": check_calibration, "families": check_families}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ok, device = gpu_present()
    if not ok:
        print(f"gpu-check: {device}: nothing checked. Run `make gpu-check` on a machine with an NVIDIA GPU.")
        return 2
    from pagedbench.bench.common import records
    from pagedbench.bench.common.environment import environment

    start = time.perf_counter()
    records.write_json(args.out / "environment.json", environment())
    verdicts = {}
    for name in args.only or CHECKS:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            result = {"passed": None, "summary": f"skipped: the {args.budget_s:.0f} s budget was spent"}
        else:
            t0 = time.perf_counter()
            try:
                result = RUNNERS[name](args.out)
            except Exception as e:  # one failed check must not lose the others
                result = {"passed": False, "summary": f"error: {type(e).__name__}: {e}"}
            result["wall_s"] = time.perf_counter() - t0
        records.write_json(args.out / f"{name}.json", {"device": device, **result})
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[result["passed"]]
        verdicts[name] = verdict
        print(f"gpu-check {name}: {verdict} - {result['summary']}", flush=True)
    return 1 if "FAIL" in verdicts.values() else 0


if __name__ == "__main__":
    sys.exit(main())
