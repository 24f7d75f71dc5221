"""The throughput study: what paging buys over contiguous allocation, end to end.

Same model, same trace, same KV memory: ``LLM(allocator="paged")`` against ``LLM(allocator="contiguous")``
(Orca Max: every request reserves ``max_model_len`` slots), serving a ShareGPT-like and an Alpaca-like
trace (:func:`bench.workloads.synthetic`, every request arriving at once: offline throughput), greedy,
each request generating exactly its trace output length (``ignore_eos``). Reported per run: generated
tokens/s, requests/s, peak and mean running batch, preemptions, mean KV utilisation (token states held /
slots in the pool). A prefix-sharing workload (one system prompt shared by every request) runs the paged
engine with prefix caching on and off: prefix hit rate, prompt tokens computed, and the memory sharing
saved (share of block-table entries served by a block another table also holds).

Correctness is checked once, on the measured runs themselves: the runs of one workload must produce
bit-identical tokens (the engine's invariance), recorded as each record's validity.

On the CPU the torch attention backend and a small random model run a length-scaled trace (see
bench/configs/throughput.yaml); on a GPU the Triton kernels and a larger model. ``main(argv)`` writes
results/throughput.json, results/throughput.md and results/throughput.png.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from pagedbench.bench.common import records as result_files
from pagedbench.bench.common.environment import RESULTS_DIR, environment
from pagedbench.bench.common.progress import progress_enabled
from pagedbench.bench.common.step_timing import timed_steps
from pagedbench.bench.studies.throughput.report import write_markdown, write_plot
from pagedbench.bench.studies.throughput.tensor_parallel import study_tensor_parallel
from pagedbench.bench.workloads.token_traces import Trace, Workload, make_trace
from pagedbench.kernels import device
from pagedbench.refengine import LLM, ModelConfig, SamplingParams, load_model
from tqdm import tqdm

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "throughput.yaml"
MODELS = Path(__file__).resolve().parents[2] / "configs" / "models.yaml"


@dataclass(frozen=True, slots=True)
class Run:
    """One way of serving a workload."""

    allocator: str  # "paged" or "contiguous"
    prefix_caching: bool
    n: int = 1  # completions per prompt
    sampled: bool = False  # temperature 1 with a seed per request (child i's seed does not depend on n)


def _params(trace: Trace, run: Run, seed: int) -> list[SamplingParams]:
    if not run.sampled:
        return [SamplingParams(max_tokens=o, n=run.n, ignore_eos=True) for o in trace.output_lens]
    return [SamplingParams(max_tokens=o, n=run.n, temperature=1.0, seed=seed * 100_003 + 1_000 * i,
                           ignore_eos=True) for i, o in enumerate(trace.output_lens)]


def _serve(loaded, cfg: dict, trace: Trace, run: Run) -> tuple[float, LLM, list, float | None]:
    """One timed generate on a fresh LLM: (wall seconds, the LLM, its outputs, host share of step time)."""
    bytes_per_slot = 2 * loaded.config.num_hidden_layers * loaded.config.num_key_value_heads \
        * loaded.config.head_dim * loaded.model.dtype.itemsize
    llm = LLM(loaded, block_size=cfg["block_size"], kv_cache_memory=cfg["kv_budget_slots"] * bytes_per_slot,
              allocator=run.allocator, enable_prefix_caching=run.prefix_caching,
              max_num_seqs=cfg["max_num_seqs"],
              max_num_batched_tokens=cfg["max_num_batched_tokens"], max_model_len=cfg["max_model_len"],
              seed=cfg["seed"])
    params = _params(trace, run, cfg["seed"])
    prompts = [list(p) for p in trace.prompts]
    with timed_steps(llm) as times:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=progress_enabled())
        wall_s = time.perf_counter() - start
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} requests rejected, e.g. {errors[0]}")
    return wall_s, llm, outs, times.host_share


def summarise_runs(run: Run, served: list[tuple]) -> tuple[dict, list]:
    """Figures of one run from its repetitions (``_serve`` results; fresh engine each, and the serving
    is deterministic, so only the wall time varies): figures from the best (least disturbed) time,
    every wall time kept. Returns (figures, every completion's tokens per request)."""
    walls = [wall for wall, _, _, _ in served]
    host_shares = [share for _, _, _, share in served]
    tokens = [[[c.token_ids for c in o.outputs] for o in outs] for _, _, outs, _ in served]
    llm, outs = served[-1][1], served[-1][2]
    if any(t != tokens[0] for t in tokens):
        raise RuntimeError(f"repetitions of {run} gave different tokens")
    s, wall_s = llm.stats, min(walls)
    figures = {
        "wall_s": wall_s,
        "wall_s_repetitions": walls,
        "host_share_of_step": host_shares[walls.index(wall_s)],  # of the best run
        "generated_tokens_per_s": s.num_generated_tokens / wall_s,
        "requests_per_s": len(outs) / wall_s,
        "peak_running_seqs": s.peak_running_seqs,
        "mean_running_seqs": s.mean_running_seqs,
        "num_preemptions": s.num_preemptions,
        "mean_kv_utilisation": s.mean_kv_utilisation,
        "mean_running_seqs_queued": s.mean_running_seqs_queued,
        "mean_kv_utilisation_queued": s.mean_kv_utilisation_queued,
        "prefix_hit_rate": s.prefix_hit_rate,
        "sharing_saving": s.sharing_saving,
        "mean_used_blocks": s.mean_used_blocks,
        "mean_table_blocks": s.mean_table_blocks,
        "peak_used_blocks": s.peak_used_blocks,
        "num_blocks": s.num_blocks,
        "num_steps": s.num_steps,
        "num_prompt_tokens": s.num_prompt_tokens,
        "num_computed_tokens": s.num_computed_tokens,
        "num_generated_tokens": s.num_generated_tokens,
    }
    return figures, tokens[0]


def study_workload(loaded, cfg: dict, w: Workload, runs: list[Run], model: str | None = None) -> list[dict]:
    """Every run of one workload, with the cross-run correctness check: the runs must give the same
    tokens (for n > 1, the children every run has: child i's seed does not depend on n)."""
    trace = make_trace(w, vocab_size=loaded.config.vocab_size, max_model_len=cfg["max_model_len"],
                       seed=cfg["seed"])
    served: list[list[tuple]] = [[] for _ in runs]
    for _ in range(cfg.get("repetitions", 1)):  # runs alternate, so a disturbance hits each alike
        for i, run in enumerate(runs):
            served[i].append(_serve(loaded, cfg, trace, run))
    results, tokens = [], []
    for run, reps in zip(runs, served):
        figures, toks = summarise_runs(run, reps)
        results.append((run, figures))
        tokens.append(toks)
    k = min(r.n for r in runs)
    same = all([c[:k] for c in t] == [c[:k] for c in tokens[0]] for t in tokens)
    records = []
    for run, f in results:
        records.append({
            "workload": {**asdict(w), "mean_prompt_len": trace.mean_prompt_len,
                         "mean_output_len": trace.mean_output_len},
            "model": model or cfg["model"],
            "implementation": {"allocator": run.allocator, "prefix_caching": run.prefix_caching, "n": run.n,
                               "contiguous_policy": "max" if run.allocator == "contiguous" else None},
            "status": "ok",
            "validity": {"valid": same, "reasons": [] if same else
                         ["runs of this workload produced different tokens"]},
            "figures": f,
        })
        tqdm.write(f"  {model or cfg['model']:8.8s} {w.name:14s} {run.allocator:10s} "
                   f"prefix_caching={run.prefix_caching!s:5s} n={run.n} "
                   f"{f['generated_tokens_per_s']:8.1f} tok/s  batch mean {f['mean_running_seqs']:6.1f}"
                   f"  KV util {f['mean_kv_utilisation']:.1%}  saved {f['sharing_saving']:.1%}  "
                   f"preemptions {f['num_preemptions']}")
    return records


def load_config(full: bool) -> dict:
    section = "gpu" if device.backend().is_gpu else "cpu"
    cfg = yaml.safe_load(CONFIG.read_text())[section]
    cfg["section"] = section
    key = "num_requests_full" if full else "num_requests"
    cfg["workloads"] = [Workload(w["name"], w["dataset"], w["length_scale"], w[key])
                        for w in cfg["workloads"]]
    p = cfg["prefix_sharing"]
    cfg["prefix_sharing"] = Workload(p["name"], p["dataset"], p["length_scale"], p[key],
                                     p["system_prompt_len"])
    p = cfg["parallel_sampling"]
    cfg["parallel_sampling"] = Workload(p["name"], p["dataset"], p["length_scale"], p[key])
    cfg["parallel_sampling_n"] = list(p["n"])
    p = cfg.get("tensor_parallel")
    if p is not None:
        cfg["tensor_parallel"] = Workload(p["name"], p["dataset"], p["length_scale"], p[key])
        cfg["tensor_parallel_sizes"], cfg["tensor_parallel_repetitions"] = list(p["sizes"]), p["repetitions"]
    return cfg


def smollm2_status(cfg: dict, requested: bool) -> str:
    """"run", or the line the report prints instead of SmolLM2's rows."""
    section = cfg.get("smollm2")
    if not section:
        return f"skipped: no smollm2 section in the {cfg['section']} config"
    if not Path(section["folder"]).is_dir():
        return f"skipped: run `make model` ({section['folder']} not found)"
    if not requested:
        return "skipped: slow on a small CPU, run with --with-smollm2"
    return "run"


def study_smollm2(cfg: dict, requested: bool) -> tuple[str, list[dict]]:
    """The allocator workloads again, served by SmolLM2 with the same KV budget in token slots."""
    status = smollm2_status(cfg, requested)
    print(f"SmolLM2: {status}")
    if status != "run":
        return status, []
    section = cfg["smollm2"]
    loaded = load_model(section["folder"], dtype=cfg["dtype"], attention_backend=cfg["attention_backend"])
    smol_cfg = {**cfg, "repetitions": section.get("repetitions", cfg.get("repetitions", 1))}
    records = []
    for w in cfg["workloads"]:
        records += study_workload(loaded, smol_cfg, w, [Run("paged", False), Run("contiguous", False)],
                                  model="smollm2")
    return status, records


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench throughput_study", description=__doc__)
    parser.add_argument("--full", action="store_true", help="the larger traces (num_requests_full)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--with-smollm2", action="store_true",
                        help="also serve the allocator workloads with SmolLM2-135M (`make model`; slow on a CPU)")
    parser.add_argument("--only-tensor-parallel", action="store_true",
                        help="run the tensor-parallel rows alone and write them into the existing "
                             "throughput.json (which keeps its other records, each part with its environment)")
    parser.add_argument("--render-only", action="store_true",
                        help="re-render throughput.md and .png from the existing throughput.json (nothing is run)")
    args = parser.parse_args(argv)
    if args.render_only:
        _write(json.loads((args.out / "throughput.json").read_text()), args.out)
        return
    cfg = load_config(args.full)
    if cfg["torch_threads"]:
        torch.set_num_threads(int(cfg["torch_threads"]))
    model_cfg = ModelConfig.from_yaml(MODELS, name=cfg["model"])
    loaded = load_model(model_cfg, dtype=cfg["dtype"], attention_backend=cfg["attention_backend"],
                        seed=cfg["seed"])
    print(f"throughput study on the {cfg['section']}: model {cfg['model']!r} (random weights), attention "
          f"backend {cfg['attention_backend']!r}, KV budget {cfg['kv_budget_slots']} token slots, "
          f"max_model_len {cfg['max_model_len']}, torch threads {torch.get_num_threads()}")
    warm = LLM(loaded, block_size=16, num_blocks=64)
    warm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=4))  # warm-up, outside every timed run
    tp_records = _tensor_parallel_rows(model_cfg, cfg)
    if args.only_tensor_parallel:
        _write(_with_tensor_parallel(args.out / "throughput.json", tp_records, cfg), args.out)
        return
    records = []
    for w in tqdm(cfg["workloads"], desc="workloads", unit="workload", disable=not progress_enabled()):
        records += study_workload(loaded, cfg, w, [Run("paged", False), Run("contiguous", False)])
    smollm2_status, smollm2_records = study_smollm2(cfg, args.with_smollm2)
    records += smollm2_records
    records += study_workload(loaded, cfg, cfg["prefix_sharing"], [Run("paged", True), Run("paged", False)])
    records += study_workload(loaded, cfg, cfg["parallel_sampling"],
                              [Run("paged", False, n, sampled=True) for n in cfg["parallel_sampling_n"]])
    config = {**_plain_config(cfg), "model_config": model_cfg.to_dict(), "full": args.full,
              "torch_threads_used": torch.get_num_threads(), "smollm2_status": smollm2_status}
    result = {"study": "throughput", "environment": environment(), "config": config, "records": records,
              "tensor_parallel": {"environment": environment(), "records": tp_records}}
    _write(result, args.out)


def _plain_config(cfg: dict) -> dict:
    """``cfg`` with its workloads as plain data."""
    plain = {**cfg, "workloads": [asdict(w) for w in cfg["workloads"]], "prefix_sharing": asdict(cfg["prefix_sharing"]),
             "parallel_sampling": asdict(cfg["parallel_sampling"])}
    if cfg.get("tensor_parallel") is not None:
        plain["tensor_parallel"] = asdict(cfg["tensor_parallel"])
    return plain


def _tensor_parallel_rows(model_cfg, cfg: dict) -> list[dict]:
    if cfg.get("tensor_parallel") is None:
        return []
    return study_tensor_parallel(model_cfg, cfg, cfg["tensor_parallel"], cfg["tensor_parallel_sizes"],
                                 cfg["tensor_parallel_repetitions"], cfg["model"])


def _with_tensor_parallel(path: Path, tp_records: list[dict], cfg: dict) -> dict:
    """The record at ``path`` with its tensor-parallel part replaced by this run's (its own environment)."""
    if not path.exists():
        raise SystemExit(f"--only-tensor-parallel: {path} does not exist; run the whole study first")
    result = json.loads(path.read_text())
    plain = _plain_config(cfg)
    result["config"].update({k: plain[k] for k in ("tensor_parallel", "tensor_parallel_sizes",
                                                   "tensor_parallel_repetitions") if k in plain})
    result["tensor_parallel"] = {"environment": environment(), "records": tp_records}
    return result


def _write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result_files.write_json(out / "throughput.json", result)
    print(write_markdown(result, out / "throughput.md"))
    write_plot(result, out / "throughput.png")
    print(f"wrote {out / 'throughput.json'}, throughput.md, throughput.png")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
