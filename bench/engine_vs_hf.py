"""Our engine against Hugging Face ``generate`` on the same model, side by side in one process.

Workload: ``num_prompts`` random prompts of ``prompt_len`` tokens, greedy, every request generating
exactly ``output_len`` tokens (``ignore_eos``); ours serves them with ``max_num_seqs = num_prompts``,
transformers as one batch (equal lengths: no padding). Reported: generated tokens/s of each, their
ratio, and for ours the host time per step as a share of step time (step wall time minus the model's
forward and LM head, over step wall time: scheduling, block tables, metadata, sampling). Correctness, checked once
on the measured runs: the share of prompts whose greedy tokens equal transformers'.

The model: a name in bench/configs/models.yaml (seeded random weights, copied into the transformers
model) or a Hugging Face checkpoint folder. ``main(argv)`` writes results/engine_vs_hf.json and .md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from pagedbench.bench.environment import RESULTS_DIR, environment, environment_markdown
from pagedbench.refengine import LLM, ModelConfig, SamplingParams, load_model

MODELS = Path(__file__).parent / "configs" / "models.yaml"


def _load(model: str, dtype: str, backend: str | None):
    """(our LoadedModel, the transformers model with the same weights)."""
    import transformers

    if Path(model).is_dir():
        loaded = load_model(model, dtype=dtype, attention_backend=backend)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=loaded.model.dtype)
    else:
        cfg = ModelConfig.from_yaml(MODELS, name=model)
        loaded = load_model(cfg, dtype=dtype, attention_backend=backend, seed=0)
        hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_dict().items() if k != "torch_dtype"})
        hf = transformers.LlamaForCausalLM(hf_cfg).to(loaded.model.dtype)
        hf.load_state_dict(loaded.model.state_dict(), strict=False)  # same names as HF's checkpoints
    return loaded, hf.eval()


def run_engine(loaded, prompts: list[list[int]], output_len: int, budget: int) -> dict:
    llm = LLM(loaded, block_size=16, max_num_seqs=len(prompts), max_num_batched_tokens=budget,
              num_blocks=len(prompts) * -(-(len(prompts[0]) + output_len) // 16) + 8)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    forward_s, step_s = [0.0], []
    model_forward, model_logits, core_step = llm.model.forward, llm.model.compute_logits, llm.core.step

    def timed(fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                forward_s[0] += time.perf_counter() - t
        return run

    def timed_step():
        t = time.perf_counter()
        try:
            return core_step()
        finally:
            step_s.append(time.perf_counter() - t)

    # the model's own compute (forward and LM head) is device time; the rest of a step is host time
    llm.model.forward, llm.model.compute_logits = timed(model_forward), timed(model_logits)
    llm.core.step = timed_step
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall_s = time.perf_counter() - t
    finally:
        del llm.model.forward, llm.model.compute_logits  # back to the class's methods
    tokens = [o.outputs[0].token_ids for o in outs]
    total_step_s = sum(step_s)
    return {"wall_s": wall_s, "generated_tokens_per_s": sum(map(len, tokens)) / wall_s,
            "num_steps": len(step_s), "mean_step_ms": 1e3 * total_step_s / max(len(step_s), 1),
            "host_share_of_step": 1.0 - forward_s[0] / total_step_s if total_step_s else None,
            "tokens": tokens}


def run_hf(hf, prompts: list[list[int]], output_len: int) -> dict:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        kw = dict(do_sample=False, pad_token_id=0)
        hf.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=2, min_new_tokens=2,
                    **kw)  # warm-up
        t = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                          min_new_tokens=output_len, **kw)
        wall_s = time.perf_counter() - t
    tokens = out[:, ids.shape[1]:].tolist()
    return {"wall_s": wall_s, "generated_tokens_per_s": sum(map(len, tokens)) / wall_s, "tokens": tokens}


def write_markdown(result: dict, path: Path) -> str:
    w, e, h = result["workload"], result["engine"], result["transformers"]
    text = (
        f"# Engine vs transformers generate ({w['model']}, {w['dtype']})\n\n"
        f"{w['num_prompts']} prompts x {w['prompt_len']} tokens, {w['output_len']} greedy tokens each "
        f"(ignore_eos), engine budget {w['max_num_batched_tokens']} tokens/step, backend "
        f"{w['attention_backend']}, {w['num_threads']} torch threads.\n\n"
        "| | tokens/s | wall s | steps | mean step ms | host share of step |\n|---|---|---|---|---|---|\n"
        f"| engine | {e['generated_tokens_per_s']:.1f} | {e['wall_s']:.2f} | {e['num_steps']} | "
        f"{e['mean_step_ms']:.1f} | {e['host_share_of_step']:.1%} |\n"
        f"| transformers | {h['generated_tokens_per_s']:.1f} | {h['wall_s']:.2f} | | | |\n\n"
        f"Ratio engine / transformers: **{result['ratio']:.2f}**. Greedy tokens equal to transformers' for "
        f"{result['correctness']['equal_prompt_share']:.0%} of prompts.\n\n"
        + environment_markdown(result["environment"])
    )
    path.write_text(text)
    return text


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m pagedbench.bench.engine_vs_hf", description=__doc__)
    p.add_argument("--model", default="small", help="a models.yaml name or a checkpoint folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backend", default=None, help="attention backend (default: the device's)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--budget", type=int, default=4096, help="engine max_num_batched_tokens")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--full", action="store_true", help="longer outputs (256 tokens; `python -m bench --full`)")
    args = p.parse_args(argv)
    if args.full:
        args.output_len = 256
    torch.set_num_threads(args.threads)
    loaded, hf = _load(args.model, args.dtype, args.backend)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, loaded.config.vocab_size, args.prompt_len).tolist()
               for _ in range(args.num_prompts)]
    engine = run_engine(loaded, prompts, args.output_len, args.budget)
    ref = run_hf(hf, prompts, args.output_len)
    equal = [a == b for a, b in zip(engine.pop("tokens"), ref.pop("tokens"))]
    result = {
        "environment": environment(),
        "workload": {"model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts,
                     "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "max_num_batched_tokens": args.budget, "attention_backend": loaded.model.attention_backend.name,
                     "num_threads": args.threads, "seed": args.seed},
        "engine": engine,
        "transformers": ref,
        "ratio": engine["generated_tokens_per_s"] / ref["generated_tokens_per_s"],
        "correctness": {"equal_prompt_share": sum(equal) / len(equal)},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_vs_hf.json").write_text(json.dumps(result, indent=2) + "\n")
    print(write_markdown(result, args.out / "engine_vs_hf.md"))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
