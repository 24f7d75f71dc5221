"""The command line's options (``python -m pagedbench.refengine generate|serve``) and the checks of the
host-memory ones, which run the engine's own rules (``engine/host_memory_arguments.py``, torch-free)."""

from __future__ import annotations

import argparse

from pagedbench.refengine.engine.host_memory_arguments import kv_offloading_bytes, swap_space_bytes
from pagedbench.refengine.engine.swap_preemption import PREEMPTION_MODES

DESCRIPTION = """\
Serve a few prompts with the reference engine and print the completions, then the run's stats
(requests, tokens, elapsed time, input and output tokens/s; preemptions, swaps and host-tier hits
when there were any).

--model is a local Hugging Face folder (e.g. models/SmolLM2-135M-Instruct, which make model builds), a
model .yaml, or a named random config (tiny, small...: nothing to download; token ids only).

examples:
  python -m pagedbench.refengine generate --model tiny --prompt-ids 1,2,3
  python -m pagedbench.refengine generate --model models/SmolLM2-135M-Instruct --chat --prompt "Hi!"
  python -m pagedbench.refengine generate --model tiny --prompt-ids 1,2,3 --prompt-ids 4,5,6 \\
      --max-tokens 40 --num-blocks 5 --preemption-mode swap   # a pool too small for both: swaps
"""

#: dtype names --dtype takes (the loader's names; checked here so that torch is not imported for --help)
DTYPE_NAMES = ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half", "float")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3; got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.refengine", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="serve prompts and print the completions", description=DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("--model", required=True, help="HF folder, model .yaml, or a named config (e.g. tiny)")
    gen.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    gen.add_argument("--prompt-ids", action="append", default=[], type=parse_ids, metavar="IDS",
                     help="a prompt of comma-separated token ids (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt (default 16)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    gen.add_argument("--seed", type=int, default=0, help="random weights and sampling (default 0)")
    gen.add_argument("--dtype", default=None, choices=DTYPE_NAMES, metavar="DTYPE",
                     help="float32, bfloat16 or float16 (default: the model's)")
    gen.add_argument("--chat", action="store_true", help="apply the model folder's chat template to text prompts")
    gen.add_argument("--batch-invariant", action="store_true",
                     help="logits bit-identical whatever else is in the batch (slower)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="run the model on N ranks (processes), each a slice of every layer (default 1)")
    gen.add_argument("--num-blocks", type=int, default=None,
                     help="KV pool blocks (default: the engine's, 4 max-length sequences); small to see preemptions")
    gen.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse the KV of a prompt prefix already computed (default on)")
    add_host_memory_arguments(gen)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)",
                           description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--model", required=True, help="HF folder, model .yaml, or a named config (e.g. tiny)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    serve.add_argument("--seed", type=int, default=0, help="random weights and sampling (default 0)")
    serve.add_argument("--dtype", default=None, choices=DTYPE_NAMES, metavar="DTYPE",
                       help="float32, bfloat16 or float16 (default: the model's)")
    serve.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks (default: the engine's)")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="running batch size limit (default 64)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (default 512)")
    serve.add_argument("--max-model-len", type=int, default=None, help="default: the model's maximum")
    serve.add_argument("--batch-invariant", action="store_true",
                       help="logits bit-identical whatever else is in the batch (slower)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="run the model on N ranks (processes), each a slice of every layer (default 1)")
    add_host_memory_arguments(serve)
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return parser


SERVE_DESCRIPTION = """Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics) with the reference engine, streaming tokens as steps produce them.

examples:
  python -m pagedbench.refengine serve --model tiny --port 8000      # token-id prompts only
  python -m pagedbench.refengine serve --model models/SmolLM2-135M-Instruct
"""


def add_host_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """Swap preemption and the prefix cache's host tier, with the engine's names and defaults (vLLM's)."""
    parser.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES,
                        help="a preempted sequence's KV: dropped and recomputed, or swapped to a host pool and "
                             "back (default recompute)")
    parser.add_argument("--swap-space", type=float, default=4, metavar="GiB",
                        help="the swap host pool, used only with --preemption-mode swap (default 4)")
    parser.add_argument("--kv-offloading-size", type=float, default=0, metavar="GiB",
                        help="a host tier of the prefix cache: evicted cached blocks are kept there and loaded "
                             "back on a hit (default 0: none)")


def check_host_memory_arguments(args: argparse.Namespace) -> None:
    """The engine's checks of the three host-memory options, before anything loads: InvalidArgumentError or
    InsufficientMemoryError naming the engine's argument (``swap_space`` for ``--swap-space``...)."""
    swap_bytes = swap_space_bytes(args.preemption_mode, args.swap_space, "paged", args.tensor_parallel_size)
    kv_offloading_bytes(args.kv_offloading_size, swap_bytes, "paged", getattr(args, "enable_prefix_caching", True),
                        args.tensor_parallel_size)
