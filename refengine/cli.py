"""``python -m pagedbench.refengine generate``: serve a few prompts and print the completions and stats;
``python -m pagedbench.refengine serve``: the OpenAI-compatible HTTP server (``refengine/server/``).

``--model`` is a local Hugging Face folder, a YAML model config, or the name of a config in the bench's
``configs/models.yaml`` (``tiny``, ``small``...: seeded random weights, nothing to download). A model
without a tokenizer takes token ids (``--prompt-ids 1,2,3``); ``--chat`` wraps each text prompt in the
folder's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s) as one user turn.

Every argument is checked before the model loads (loading a real checkpoint takes seconds), and torch is
imported only then, so ``--help`` and a mistake answer at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from pagedbench.refengine.cli_arguments import build_parser, check_host_memory_arguments
from pagedbench.refengine.engine.sampling_params import SamplingParams
from pagedbench.refengine.errors import InsufficientMemoryError, InvalidArgumentError
from pagedbench.refengine.model.chat_template import ChatTemplateError, chat_template, render_chat

if TYPE_CHECKING:
    from pagedbench.refengine.engine.outputs import RequestOutput
    from pagedbench.refengine.engine.stats import LLMStats

class CLIError(Exception):
    """A mistake on the command line: printed as ``error: ...`` with exit status 2, no traceback."""


def named_configs_path() -> Path | None:
    """The bench's table of named random models (a data file; no bench code is imported)."""
    try:
        path = resources.files("pagedbench.bench").joinpath("configs/models.yaml")
    except ModuleNotFoundError:
        return None
    return Path(str(path)) if path.is_file() else None


def resolve_model(spec: str):
    """``spec`` as ``load_model`` takes it: an existing path as is, a known name as its ModelConfig."""
    if Path(spec).expanduser().exists():
        return spec
    table = named_configs_path()
    names: list[str] = []
    if table is not None:
        import yaml

        names = sorted(yaml.safe_load(table.read_text()))
        if spec in names:
            from pagedbench.refengine.model.config import ModelConfig

            return ModelConfig.from_yaml(table, name=spec)
    known = f"; named configs: {', '.join(names)}" if names else ""
    raise CLIError(f"--model {spec!r}: no such model folder or .yaml config, and not a named config{known}")


def check_serve_arguments(args: argparse.Namespace):
    """Everything ``serve`` can check without the weights: returns the model source."""
    if not 0 < args.port < 65536:
        raise CLIError(f"--port must be in 1..65535; got {args.port}")
    if args.seed < 0:
        raise CLIError(f"--seed must be >= 0; got {args.seed}")
    for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "tensor_parallel_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    check_host_memory_arguments(args)
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise CLIError(f"serve needs {', '.join(missing)}: pip install 'pagedbench[serve]'")
    return resolve_model(args.model)


def host_memory_kwargs(args: argparse.Namespace) -> dict:
    return {"preemption_mode": args.preemption_mode, "swap_space": args.swap_space,
            "kv_offloading_size": args.kv_offloading_size}


def serve(args: argparse.Namespace) -> int:
    source = check_serve_arguments(args)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    from pagedbench.refengine.engine.llm import LLM
    from pagedbench.refengine.server.launch import serve_forever

    llm = LLM(source, dtype=args.dtype, seed=args.seed, batch_invariant=args.batch_invariant,
              num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size, **host_memory_kwargs(args))
    folder = source if isinstance(source, str) and Path(source).expanduser().is_dir() else None
    with llm:  # (its tensor-parallel workers stopped on the way out)
        serve_forever(llm, model_name=args.served_model_name or args.model, model_folder=folder, host=args.host,
                      port=args.port, log_level=args.log_level)
    return 0


def chat_prompt(folder: str, tokenizer, text: str) -> dict:
    """One user turn rendered with the folder's chat template, as token ids (the template adds BOS)."""
    try:
        return render_chat(folder, tokenizer, [{"role": "user", "content": text}])
    except ChatTemplateError as e:
        raise CLIError(f"--chat: {e}") from None


def format_output(i: int, out: RequestOutput, label: str | None = None) -> str:
    """``label`` names the prompt in place of its text or ids (a chat prompt: the user's text)."""
    prompt = label or (repr(out.prompt) if out.prompt is not None else f"ids {out.prompt_token_ids}")
    if out.error is not None:
        return f"[{i}] {prompt}\n    error: {out.error}"
    lines = [f"[{i}] {prompt}"]
    for c in out.outputs:
        body = repr(c.text) if c.text is not None else f"ids {list(c.token_ids)}"
        lines.append(f"    -> {body} ({c.finish_reason})")
    return "\n".join(lines)


def format_stats(s: LLMStats, load: tuple[float, int] | None = None) -> str:
    """The stats line; ``load``: ``(1-minute load average, cores)`` (default: this machine's). Above the
    cores, other work shares them and tokens/s reads low (5-10x on a busy two-core machine): the line
    says so rather than let a reader take it for the engine's speed."""
    line = (f"stats: {s.num_requests} requests, {s.num_prompt_tokens} prompt tokens, {s.num_generated_tokens} "
            f"generated tokens in {s.elapsed_s:.3f} s ({s.num_steps} steps): input {s.input_tokens_per_s:.1f} "
            f"tok/s, output {s.output_tokens_per_s:.1f} tok/s{preemption_stats(s)}")
    if load is None:
        load = machine_load()
    if load is not None and load[0] > load[1]:
        line += (f" [machine loaded: load average {load[0]:.1f} on {load[1]} cores; other work shares them, "
                 "so these rates read low]")
    return line


def preemption_stats(s: LLMStats) -> str:
    """What the stats line adds when it happened: preemptions, swaps, the prefix cache's host tier."""
    parts = []
    if s.num_preemptions:
        parts.append(f"{s.num_preemptions} preemptions")  # (swapped sequences included)
    if s.num_swap_outs or s.num_swap_fallbacks:
        parts.append(f"swaps: {s.num_swap_outs} groups out ({s.num_swapped_out_blocks} blocks), {s.num_swap_ins} in"
                     + (f", {s.num_swap_fallbacks} fell back to recompute" if s.num_swap_fallbacks else ""))
    if s.num_host_blocks:
        parts.append(f"host tier of {s.num_host_blocks} blocks: {s.prefix_host_hit_tokens} prompt tokens loaded, "
                     f"{s.num_offloaded_blocks} blocks stored")
    return "".join(f"; {p}" for p in parts)


def machine_load() -> tuple[float, int] | None:
    """``(1-minute load average, cores)``, None where the platform has no load average."""
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return None


def check_arguments(args: argparse.Namespace):
    """Everything that can be checked without the weights: returns (model source, SamplingParams)."""
    if not args.prompt and not args.prompt_ids:
        raise CLIError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    if args.seed < 0:
        raise CLIError(f"--seed must be >= 0; got {args.seed}")
    for name in ("tensor_parallel_size", "num_blocks"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    check_host_memory_arguments(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    source = resolve_model(args.model)
    is_folder = isinstance(source, str) and Path(source).expanduser().is_dir()
    if args.chat:
        if not is_folder:
            raise CLIError("--chat needs a model folder with a chat template")
        chat_template(source)
    if args.prompt and not (is_folder and (Path(source).expanduser() / "tokenizer.json").is_file()):
        raise CLIError(f"--model {args.model!r} has no tokenizer: pass token ids with --prompt-ids")
    return source, params


def generate(args: argparse.Namespace) -> int:
    source, params = check_arguments(args)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    from pagedbench.refengine.engine.llm import LLM

    llm = LLM(source, dtype=args.dtype, seed=args.seed, batch_invariant=args.batch_invariant,
              tensor_parallel_size=args.tensor_parallel_size, num_blocks=args.num_blocks,
              enable_prefix_caching=args.enable_prefix_caching, **host_memory_kwargs(args))
    with llm:
        return _generate(args, llm, source, params, start)


def _generate(args: argparse.Namespace, llm, source, params: SamplingParams, start: float) -> int:
    print(f"loaded in {time.perf_counter() - start:.1f} s; generating {len(args.prompt) + len(args.prompt_ids)} "
          f"prompt(s), up to {args.max_tokens} tokens each", file=sys.stderr, flush=True)
    texts = [chat_prompt(source, llm.tokenizer, p) if args.chat else p for p in args.prompt]
    outs = llm.generate([*texts, *args.prompt_ids], params, use_tqdm=True if sys.stderr.isatty() else None)
    labels = [f"{p!r} (chat, {len(t['prompt_token_ids'])} tokens)" for p, t in zip(args.prompt, texts)] \
        if args.chat else []
    for i, out in enumerate(outs):
        print(format_output(i, out, labels[i] if i < len(labels) else None))
    print(format_stats(llm.stats))
    return 1 if any(o.error is not None for o in outs) else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return serve(args) if args.command == "serve" else generate(args)
    except (CLIError, FileNotFoundError, InvalidArgumentError, InsufficientMemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
