"""Write ``bench/data/vidur/mlp_tp1.csv``: a few rows of Vidur's per-layer profiles (run once, by hand).

``python -m pagedbench.bench.costmodel.vidur_extract <vidur git dir>`` reads, at that checkout's HEAD,
``data/profiling/compute/{a100,h100}/<org>/<model>/mlp.csv``, keeps tensor-parallel degree 1 and a few
token counts, and writes each operation's median time in ms (Vidur's CUDA timers record ms per call of
one layer's operation; its sklearn predictor reads ``time_stats.<op>.median``). Token counts profiled
twice are averaged. The fit (:mod:`pagedbench.bench.costmodel.vidur_fit`) reads only the written CSV.

``--all-tokens`` writes instead ``bench/data/vidur/mlp_tp1_all_tokens.csv``: every token count Vidur
profiled at tensor-parallel degree 1 (1, 2, 4, then steps of 8 to 1024, 16 to 2048, 32 to 4096: 259
counts), with the four GEMMs' medians and ``other_ms``, the sum of the five other operations (norms,
rotary, activation, residual add), so the file stays small. The wave-aware fit
(:mod:`pagedbench.bench.costmodel.tile_fit`) reads it.

``--tp-shards`` writes ``bench/data/vidur/mlp_tp_shards.csv``: the rows Vidur profiled at tensor-parallel
degrees 2, 4 and 8 (one GPU's share of each GEMM), at the same ten token counts, as one layer's total
(``layer_ms``, the nine operations) and its GEMMs (``gemm_ms``): what checks the per-GPU split of
:mod:`pagedbench.bench.costmodel.rank_shard`.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data" / "vidur" / "mlp_tp1.csv"
OUT_ALL_TOKENS = OUT.with_name("mlp_tp1_all_tokens.csv")
OUT_TP_SHARDS = OUT.with_name("mlp_tp_shards.csv")
TP_SHARD_DEGREES = ("2", "4", "8")
#: Vidur's model path -> our model profile name
MODELS = {
    "meta-llama/Llama-2-7b-hf": "llama-2-7b",
    "meta-llama/Llama-2-70b-hf": "llama-2-70b",
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
    "meta-llama/Meta-Llama-3-70B": "llama-3-70b",
    "codellama/CodeLlama-34b-Instruct-hf": "codellama-34b",
    "internlm/internlm-20b": "internlm-20b",
    "Qwen/Qwen-72B": "qwen-72b",
    "microsoft/phi-2": "phi-2",
}
GPUS = {"a100": "a100-80gb", "h100": "h100-sxm"}  # Vidur's device SKUs are the 80 GB parts
NUM_TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: the operations of one layer outside attention, in Vidur's order
OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True,
                          text=True).stdout


GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


def _profiles(git_dir: str, degrees: tuple[str, ...] = ("1",)):
    """(our gpu, our model, Vidur path, records at those tensor-parallel degrees) of every profiled pair."""
    for vgpu, gpu in GPUS.items():
        for vmodel, model in MODELS.items():
            path = f"data/profiling/compute/{vgpu}/{vmodel}/mlp.csv"
            try:
                text = _git(git_dir, "cat-file", "-p", f"HEAD:{path}")
            except subprocess.CalledProcessError:
                continue  # not profiled on this GPU (Llama-3 on H100)
            yield gpu, model, path, [r for r in csv.DictReader(text.splitlines())
                                     if r["num_tensor_parallel_workers"] in degrees]


def _op_ms(records: list[dict], op: str) -> float:
    # phi-2 has no post_attention_layernorm column: Vidur counts a missing op as 0 ms.
    return sum(float(r.get(f"time_stats.{op}.median") or 0) for r in records) / len(records)


def extract_all_tokens(git_dir: str) -> None:
    commit = _git(git_dir, "rev-parse", "HEAD").strip()
    rows = []
    for gpu, model, _, records in _profiles(git_dir):
        for n in sorted({int(r["num_tokens"]) for r in records}):
            same = [r for r in records if int(r["num_tokens"]) == n]
            other = sum(_op_ms(same, op) for op in OPS if op not in GEMM_OPS)
            rows.append({"gpu": gpu, "model": model, "num_tokens": n,
                         **{f"{op}_ms": f"{_op_ms(same, op):.4f}" for op in GEMM_OPS}, "other_ms": f"{other:.4f}"})
    with OUT_ALL_TOKENS.open("w", newline="") as f:
        f.write(f"# Extracted from github.com/microsoft/vidur at commit {commit}"
                " (MIT licence, see README.md),\n# data/profiling/compute/{a100,h100}/<org>/<model>/mlp.csv, by"
                " bench/costmodel/vidur_extract.py --all-tokens:\n# tensor-parallel degree 1, every profiled token"
                " count, median ms per layer per op; other_ms = the five non-GEMM ops summed.\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {OUT_ALL_TOKENS}")


def extract_tp_shards(git_dir: str) -> None:
    commit = _git(git_dir, "rev-parse", "HEAD").strip()
    rows = []
    for gpu, model, _, records in _profiles(git_dir, TP_SHARD_DEGREES):
        for tp in TP_SHARD_DEGREES:
            for n in NUM_TOKENS:
                same = [r for r in records if r["num_tensor_parallel_workers"] == tp and int(r["num_tokens"]) == n]
                if not same:
                    continue
                rows.append({"gpu": gpu, "model": model, "tensor_parallel_size": int(tp), "num_tokens": n,
                             "layer_ms": f"{sum(_op_ms(same, op) for op in OPS):.4f}",
                             "gemm_ms": f"{sum(_op_ms(same, op) for op in GEMM_OPS):.4f}"})
    with OUT_TP_SHARDS.open("w", newline="") as f:
        f.write(f"# Extracted from github.com/microsoft/vidur at commit {commit}"
                " (MIT licence, see README.md),\n# data/profiling/compute/{a100,h100}/<org>/<model>/mlp.csv, by"
                " bench/costmodel/vidur_extract.py --tp-shards:\n# tensor-parallel degrees 2, 4, 8 (one GPU's"
                " share), median ms per layer: the nine ops (layer_ms) and the four GEMMs (gemm_ms).\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {OUT_TP_SHARDS}")


def main(argv: list[str]) -> None:
    if argv[1:] == ["--all-tokens"]:
        extract_all_tokens(argv[0])
        return
    if argv[1:] == ["--tp-shards"]:
        extract_tp_shards(argv[0])
        return
    git_dir = argv[0]
    commit = _git(git_dir, "rev-parse", "HEAD").strip()
    rows = []
    for gpu, model, path, records in _profiles(git_dir):
        for n in NUM_TOKENS:
            same = [r for r in records if int(r["num_tokens"]) == n]
            rows.append({"gpu": gpu, "model": model, "vidur_path": path, "num_tokens": n,
                         **{f"{op}_ms": f"{_op_ms(same, op):.4f}" for op in OPS}})
    with OUT.open("w", newline="") as f:
        f.write(f"# Extracted from github.com/microsoft/vidur at commit {commit}"
                " (MIT licence, see README.md)\n# by bench/costmodel/vidur_extract.py:"
                " tensor-parallel degree 1, median ms per layer per op.\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
