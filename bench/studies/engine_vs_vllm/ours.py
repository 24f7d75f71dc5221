"""Our engine as a study runner, in this process (this venv's torch)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from pagedbench.bench.studies.engine_vs_vllm.comparison import NotRunnable, Run, Startup
from pagedbench.conformance.gate.environment import version_of


class OursRunner:
    """PagedBench's ``LLM`` on a Hugging Face folder: prefix caching off, a KV pool of ``kv_cache_bytes``."""

    name = "pagedbench"

    def __init__(self, model_dir: Path, *, dtype: str, kv_cache_bytes: int, max_num_seqs: int, threads: int):
        self.model_dir, self.dtype = Path(model_dir), dtype
        self.kv_cache_bytes, self.max_num_seqs, self.threads = kv_cache_bytes, max_num_seqs, threads
        self.llm = None

    def start(self) -> Startup:
        if not self.model_dir.is_dir():
            raise NotRunnable(f"{self.model_dir} not found: run `make model`")
        import torch
        from pagedbench.refengine import LLM, SamplingParams, load_model

        torch.set_num_threads(self.threads)
        t = time.perf_counter()
        loaded = load_model(self.model_dir, dtype=self.dtype)
        self.llm = LLM(loaded, kv_cache_memory=self.kv_cache_bytes, enable_prefix_caching=False,
                       max_num_seqs=self.max_num_seqs)
        startup_s = time.perf_counter() - t
        t = time.perf_counter()
        self.llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        first_request_s = time.perf_counter() - t
        return Startup(startup_s, first_request_s,
                       versions={"torch": torch.__version__, "pagedbench": version_of("pagedbench")},
                       settings={"threads": torch.get_num_threads(), "kv_cache_bytes": self.kv_cache_bytes,
                                 "num_blocks": self.llm.pool.num_blocks, "block_size": self.llm.block_size,
                                 "max_num_seqs": self.max_num_seqs,
                                 "max_num_batched_tokens": self.llm.max_num_batched_tokens,
                                 "enable_prefix_caching": False,
                                 "dtype": str(loaded.model.dtype),
                                 "attention_backend": loaded.model.attention_backend.name,
                                 "linear_paths": " ".join(f"{site}:{c['path']}"
                                                          for site, c in self.llm.linear_paths.items())})

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Run:
        from pagedbench.refengine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)  # greedy: temperature 0 by default
        t = time.perf_counter()
        outs = self.llm.generate([list(p) for p in prompts], params, use_tqdm=False)
        wall_s = time.perf_counter() - t
        return Run(wall_s, tuple(tuple(o.outputs[0].token_ids) for o in outs))

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
