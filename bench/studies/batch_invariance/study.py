"""What the batch-invariant mode costs: the engine's wall time with ``batch_invariant=True`` over the
default mode's, on the same model and requests, runs of the two interleaved in one process.

``python -m pagedbench.bench --only batch_invariance``. Each case serves one batch of random prompts
(greedy, ``ignore_eos``) under a token budget that chunks the prefills, once per mode per round; the
ratio is the median over rounds of invariant / default. The run also records whether the two modes'
greedy tokens agreed (they may not: the fixed order rounds differently, and a near-tie can flip) and
checks, on one request, that the invariant mode's first logits are bit-identical alone and in the batch.
Cases: the ``small`` random model of bench/configs/models.yaml, and SmolLM2-135M-Instruct when
``make model`` has prepared it (``--no-smollm2`` skips it). Writes ``results/batch_invariance.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pagedbench.bench.common import environment as env_mod
from pagedbench.bench.common import records
from pagedbench.bench.common.model_files import MODELS_YAML, SMOLLM2_DIR
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.model.config import ModelConfig
from tabulate import tabulate


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    model: str  # a name in models.yaml or a folder
    num_prompts: int
    max_prompt_len: int
    max_tokens: int
    budget: int  # max_num_batched_tokens
    rounds: int


CASES = (Case("small", "small", 16, 96, 16, 64, 5), Case("smollm2", str(SMOLLM2_DIR), 8, 64, 8, 64, 3))


def _load(model: str):
    if Path(model).is_dir():
        return load_model(model, dtype="float32", attention_backend="torch-batched")
    return load_model(ModelConfig.from_yaml(MODELS_YAML, name=model), attention_backend="torch-batched", seed=0)


def _prompts(case: Case, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(8, case.max_prompt_len + 1, (case.num_prompts,), generator=gen)
    return [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lens]


def _first_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """The first request's logits at its prompt's last position, served beside the others."""
    rows = {}
    llm.executor.logits_hook = lambda ids, logits: [rows.setdefault(s, logits[i].clone()) for i, s in enumerate(ids)]
    first = llm.core.new_request(prompts[0], SamplingParams(max_tokens=1, ignore_eos=True))
    llm.core.add(first)
    for p in prompts[1:]:
        llm.core.add(llm.core.new_request(p, SamplingParams(max_tokens=1, ignore_eos=True)))
    while llm.scheduler.has_unfinished():
        llm.step()
    llm.executor.logits_hook = None
    return rows[first.children[0].seq_id]


def measure(case: Case) -> dict:
    loaded = _load(case.model)
    prompts = _prompts(case, loaded.config.vocab_size)
    params = SamplingParams(max_tokens=case.max_tokens, ignore_eos=True)

    def make(invariant: bool) -> LLM:
        return LLM(loaded, block_size=16, num_blocks=1024, enable_prefix_caching=False,
                   max_num_batched_tokens=case.budget, batch_invariant=invariant)

    times: dict[bool, list[float]] = {False: [], True: []}
    tokens = {}
    for r in range(case.rounds):
        for invariant in ((False, True) if r % 2 == 0 else (True, False)):  # alternate who goes first
            llm = make(invariant)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[invariant].append(time.perf_counter() - start)
            tokens[invariant] = [o.outputs[0].token_ids for o in outs]
    alone = _first_logits(make(True), prompts[:1])
    beside = _first_logits(make(True), prompts)
    ratios = [b / a for a, b in zip(times[False], times[True])]
    return {"case": case.name, "model": case.model, "num_prompts": case.num_prompts,
            "prompt_tokens": sum(map(len, prompts)), "max_tokens": case.max_tokens, "budget": case.budget,
            "rounds": case.rounds, "default_s": statistics.median(times[False]),
            "invariant_s": statistics.median(times[True]), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "same_tokens": sum(a == b for a, b in zip(tokens[False], tokens[True])),
            "alone_equals_beside": bool(torch.equal(alone, beside))}


def markdown(doc: dict) -> str:
    rows = []
    for r in doc["results"]:
        if "skipped" in r:
            rows.append([r["case"], r["skipped"], "", "", "", "", ""])
            continue
        rows.append([r["case"], f"{r['num_prompts']} prompts, {r['prompt_tokens']} tokens, +{r['max_tokens']} "
                     f"each, budget {r['budget']}", f"{r['default_s']:.2f}", f"{r['invariant_s']:.2f}",
                     f"{r['ratio']:.2f}× ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}, {r['rounds']} rounds)",
                     f"{r['same_tokens']}/{r['num_prompts']}", "yes" if r["alone_equals_beside"] else "NO"])
    return "\n".join([
        "# The batch-invariant mode's cost", "",
        "Generated by `python -m pagedbench.bench --only batch_invariance`; do not edit.", "",
        tabulate(rows, ["case", "workload", "default (s)", "batch_invariant (s)", "invariant / default (median)",
                        "same greedy tokens", "logits alone == in batch"], tablefmt="github"), "",
        "Both modes ran in this process, interleaved round by round, on one torch thread (CPU, the "
        "torch-batched backend). The invariant mode pads the dense layers' rows to whole 32-row tiles, calls "
        "every matmul one tile at a time, and attends without BLAS in fixed key tiles; its greedy tokens may "
        "differ from the default mode's where two logits nearly tie (another rounding, not an error).", "",
        env_mod.environment_markdown(doc["environment"])])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench batch_invariance", description=__doc__)
    parser.add_argument("--full", action="store_true", help="(same as the default)")
    parser.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2 case")
    parser.add_argument("--out", default=str(env_mod.RESULTS_DIR), help="output folder (default: results/)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the mode's guarantee holds for one thread (refengine.model.batch_invariance)
    results = []
    for case in CASES:
        if case.name == "smollm2" and (args.no_smollm2 or not SMOLLM2_DIR.is_dir()):
            why = "skipped (--no-smollm2)" if args.no_smollm2 else f"skipped: {SMOLLM2_DIR} absent (`make model`)"
            results.append({"case": case.name, "skipped": why})
            continue
        print(f"batch_invariance: {case.name} ...", flush=True)
        results.append(measure(case))
    doc = {"schema_version": records.SCHEMA_VERSION, "environment": env_mod.environment(), "results": results}
    text = markdown(doc)
    records.write_json(Path(args.out) / "batch_invariance.json", doc)
    records.write_text(Path(args.out) / "batch_invariance.md", text)
    print(text)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
