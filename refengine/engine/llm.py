"""The offline engine: ``LLM(model).generate(prompts, sampling_params)``, modelled on vLLM's offline API.

One :meth:`LLM.generate` call validates every request first, queues the good ones and steps until all
finish. Each step:

1. the :class:`~refengine.scheduler.Scheduler` plans it (decodes, prefill chunks, admissions, maybe
   preemptions) and returns the copy-on-write copies, applied to the KV pool first (``copy_blocks``);
2. one :class:`~refengine.attention_backend.AttentionMetadata` is built for the flattened tokens;
3. the model runs, writing the step's K/V into the paged cache and attending through the block tables;
4. each sequence that reached its last token samples from its own logits row with its own generator
   (a parallel-sampling request samples all ``n`` children from its prompt's last row, then forks;
   greedy rows share one batched argmax);
5. the scheduler appends the tokens, finishes sequences (blocks freed at once) and, with prefix caching,
   publishes the blocks whose K/V the step wrote.

Bad requests (empty prompt, token outside the vocabulary, prompt longer than the model's maximum, one
that could never fit the KV pool even alone, ``n > max_num_seqs``, a string without a tokenizer...) are
never run: their :class:`RequestOutput` has ``error`` set and no outputs, and the rest of the batch
completes. ``generate(..., strict=True)`` instead raises :class:`InvalidRequestError` listing every bad
request before running anything.

A step that raises is rolled back (see ``engine/core.py``): the requests it touched are back in the
queue as if it had never been planned. ``generate`` then retries each of them through at most
``max_step_retries`` failed steps; past that a request is aborted with ``error`` naming the failure,
and the rest of the batch completes. ``KeyboardInterrupt`` and ``SystemExit`` abort every request
(their blocks freed) and propagate.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from collections.abc import Sequence as Seq

import torch
from pagedbench.refengine.engine.beam_params import BeamSearchOutput, BeamSearchParams
from pagedbench.refengine.engine.core import EngineCore, StepReport, WallClock
from pagedbench.refengine.engine.cpu_threads import engine_threads
from pagedbench.refengine.engine.host_memory_arguments import kv_offloading_bytes as _kv_offloading_bytes
from pagedbench.refengine.engine.host_memory_arguments import swap_space_bytes as _swap_space_bytes
from pagedbench.refengine.engine.leak_check import check_no_leak
from pagedbench.refengine.engine.llm_arguments import (
    ALLOCATORS,
    FP8_BACKENDS,
    KV_CACHE_DTYPES,
    POLICIES,
    PREEMPTION_MODES,
    poison_from_env,
)
from pagedbench.refengine.engine.llm_arguments import check_options as _check_options
from pagedbench.refengine.engine.llm_arguments import positive as _positive
from pagedbench.refengine.engine.llm_arguments import tensor_parallel_size as _tensor_parallel_size
from pagedbench.refengine.engine.model_executor import ModelExecutor
from pagedbench.refengine.engine.outputs import RequestOutput
from pagedbench.refengine.engine.progress import GenerateProgress, wants_bar
from pagedbench.refengine.engine.prompts import unpack_prompt
from pagedbench.refengine.engine.request import Request
from pagedbench.refengine.engine.sampling_params import SamplingParams
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule
from pagedbench.refengine.engine.sequence import Sequence
from pagedbench.refengine.engine.stats import LLMStats, StatsRecorder
from pagedbench.refengine.engine.stop_strings import StopStringWatcher
from pagedbench.refengine.errors import InvalidArgumentError, InvalidRequestError
from pagedbench.refengine.kv.block_manager import BlockManager
from pagedbench.refengine.kv.block_pool import BlockPool
from pagedbench.refengine.kv.contiguous import ContiguousBlockManager
from pagedbench.refengine.kv.host_pool import HostBlockAllocator, HostBlockPool
from pagedbench.refengine.model.config import resolve_dtype
from pagedbench.refengine.model.loader import LoadedModel, load_model

__all__ = ["ALLOCATORS", "FP8_BACKENDS", "KV_CACHE_DTYPES", "LLM", "POLICIES", "PREEMPTION_MODES", "poison_from_env"]


class LLM:
    """A model served with continuous batching over a paged (or contiguous) KV cache.

    ``model``: a local Hugging Face folder, a ``ModelConfig`` / dict / YAML path (seeded random
    weights), or a :class:`~refengine.loader.LoadedModel`. KV memory: ``num_blocks`` blocks or a
    ``kv_cache_memory`` budget in bytes (at most one; default ``4 * ceil(max_model_len / block_size)``
    blocks, a modest pool). ``allocator="contiguous"`` reserves ``max_model_len`` slots per request
    (Orca Max) instead of paging; it cannot share blocks (no prefix caching; ``n > 1`` children are
    run as independent sequences). ``max_model_len`` defaults to the model's maximum.

    ``dtype`` (a torch dtype or its name; None = the checkpoint's) and ``attention_backend``
    ("torch", "torch-batched", "triton", or None: triton on a GPU, torch-batched on the CPU) are the
    loader's; with a LoadedModel they are its own (a different dtype or any backend is an error). ``seed`` seeds the
    random weights of a config-built model and the sampling of requests given ``seed=None``.
    ``check_invariants=True`` runs the block manager's invariant check after every step (tests).
    ``batch_invariant=True``: a request's logits (so its greedy and seeded tokens) are bit-identical
    whatever else is in the batch and however its prefill is chunked, at a cost (fixed row tiles for
    every matmul, attention in a fixed order: ``refengine.model.batch_invariance``).
    ``poison_kv_cache``: fill the KV pool with NaN, so a read of a slot nobody wrote shows as NaN logits
    (debugging, tests: a full pass over the pool's memory); None: on when the environment sets
    ``PAGEDBENCH_POISON_KV=1`` (the test suite's conftest does), else the pool is left zeroed by the OS.

    Scheduling: ``policy`` ("mixed": prefill chunks ride in decode steps, as vLLM today; "separate":
    a step is prompts or decodes, as vLLM v0.1) and ``watermark_blocks`` (free blocks admission keeps
    for running sequences' growth; paged allocator only), with ``max_num_seqs`` and
    ``max_num_batched_tokens`` (see ``engine/scheduler.py``).
    ``kv_cache_dtype``: "auto" (the model's dtype) or "fp8_e4m3": K and V stored as float8_e4m3fn with
    per-tensor scales of 1.0 (vLLM's default without calibration), half the bytes of fp16 per token, on
    every built-in attention backend.

    ``tensor_parallel_size=N`` (at most the machine's GPUs, or CPU cores): the model runs on N ranks, each
    holding a slice of every layer and ``num_key_value_heads / N`` KV heads in a pool of its own with the
    same block ids (``refengine.parallel``). This process is rank 0 (the scheduler, sampling); ranks
    1..N-1 are spawned at construction and stopped by :meth:`close` (or ``with LLM(...) as llm``, or at
    exit). ``model`` must then be what each rank can load itself (not a LoadedModel), and a rank's failure
    fails the step and every later one with ``TensorParallelError`` naming the rank.

    ``num_threads``: torch's CPU threads (None: the physical cores this process may use, unless
    ``OMP_NUM_THREADS`` is set or torch already has fewer; ``engine/cpu_threads.py``). torch's count is
    process-wide: it stays set after the ``LLM`` is gone.

    ``linear_path``: "auto" (default: per call site, oneDNN on a weight packed once where it measures
    faster than ``F.linear`` on this machine at those threads; ``refengine/model/prepacked_linear.py``),
    "torch" (``F.linear`` everywhere) or "onednn". The choice, with its timings, is in ``linear_paths``.
    A packed weight costs its bytes again; a GPU, and ``tensor_parallel_size > 1``, run ``F.linear``.

    ``preemption_mode``: "recompute" (a victim's blocks are dropped and its tokens computed again) or
    "swap" (paged allocator only: its blocks are copied to a host pool of ``swap_space`` GiB and back,
    ``engine/swap_preemption.py``; a group the host pool cannot take is recomputed and counted in
    ``stats.num_swap_fallbacks``). ``swap_space`` (GiB, default 4 as vLLM's) is allocated only in swap
    mode, as whole blocks (0, or less than a block: every preemption falls back to recompute); it is
    refused when larger than the host's available memory.

    ``kv_offloading_size`` (GiB, vLLM's name; default 0: none; paged allocator with prefix caching): a host
    tier of the prefix cache of that many GiB (whole blocks). A cached block evicted from the KV pool keeps
    its KV there, keyed by its prefix hash, LRU; a prompt whose prefix misses the pool but hits the host is
    loaded back (a copy in the step, before its forward) instead of computed. ``stats`` counts device hits
    (``prefix_hit_tokens``), host hits (``prefix_host_hit_tokens``) and computed prompt tokens
    (``prefix_computed_tokens``) apart. Refused when larger than the host's available memory (with
    ``swap_space`` in swap mode), and with ``tensor_parallel_size > 1`` for now.
    """

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, enable_prefix_caching: bool = True,
                 allocator: str = "paged", attention_backend=None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, dtype: torch.dtype | str | None = None, seed: int = 0,
                 max_model_len: int | None = None, check_invariants: bool = False, policy: str = "mixed",
                 watermark_blocks: int = 0, batch_invariant: bool = False,
                 poison_kv_cache: bool | None = None, kv_cache_dtype: str = "auto",
                 tensor_parallel_size: int = 1, preemption_mode: str = "recompute", swap_space: float = 4,
                 kv_offloading_size: float = 0, num_threads: int | None = None,
                 linear_path: str = "auto") -> None:
        # every argument checked before the model loads
        self.tensor_parallel_size = _tensor_parallel_size(tensor_parallel_size, model, attention_backend,
                                                          batch_invariant)
        swap_bytes = _swap_space_bytes(preemption_mode, swap_space, allocator, self.tensor_parallel_size)
        offload_bytes = _kv_offloading_bytes(kv_offloading_size, swap_bytes, allocator, enable_prefix_caching,
                                             self.tensor_parallel_size)
        _check_options(allocator=allocator, policy=policy, watermark_blocks=watermark_blocks,
                       kv_cache_dtype=kv_cache_dtype, batch_invariant=batch_invariant, linear_path=linear_path,
                       tensor_parallel_size=self.tensor_parallel_size)
        self.block_size = _positive("block_size", block_size)
        self.max_num_seqs = _positive("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InvalidArgumentError(f"seed must be an int >= 0, got {seed!r}")
        self.seed = seed
        self.num_threads = engine_threads(num_threads)
        if isinstance(model, LoadedModel):
            if dtype is not None and resolve_dtype(dtype) != model.model.dtype:
                raise InvalidArgumentError(
                    f"dtype {dtype} differs from the loaded model's {model.model.dtype}")
            if attention_backend is not None:
                raise InvalidArgumentError("a LoadedModel brings its own attention backend; pass "
                                           "attention_backend to load_model instead")
            self.loaded = model
        else:
            self.loaded = load_model(model, dtype=dtype, attention_backend=attention_backend, seed=seed)
        self.model, self.config, self.tokenizer = self.loaded.model, self.loaded.config, self.loaded.tokenizer
        # after the threads are set: "auto" measures at the count the engine runs with
        self.linear_paths = self.model.set_linear_paths(linear_path if self.tensor_parallel_size == 1 else "torch")
        kv_dtype = self.model.dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]
        backend = getattr(getattr(self.model, "attention_backend", None), "name", None)
        if kv_cache_dtype != "auto" and backend not in FP8_BACKENDS:
            raise InvalidArgumentError(f"kv_cache_dtype={kv_cache_dtype!r} needs the attention backend "
                                       f"{' or '.join(map(repr, FP8_BACKENDS))}; the model has {backend!r}")
        self.kv_cache_dtype = kv_cache_dtype
        limit = self.config.max_position_embeddings
        self.max_model_len = limit if max_model_len is None else _positive("max_model_len", max_model_len)
        if self.max_model_len > limit:
            raise InvalidArgumentError(f"max_model_len {self.max_model_len} exceeds the model's {limit}")
        if num_blocks is None and kv_cache_memory is None:
            num_blocks = 4 * -(-self.max_model_len // self.block_size)
        cfg = self.config
        tp = self.tensor_parallel_size
        if tp > 1:  # before any worker starts
            from pagedbench.refengine.parallel.linear import check_shardable

            check_shardable(cfg, tp)
        # under tensor parallelism this is rank 0's pool: its share of the KV heads (a memory budget is per rank)
        self.pool = BlockPool(cfg.num_hidden_layers, cfg.num_key_value_heads // tp, cfg.head_dim, self.block_size,
                              kv_dtype, num_blocks=num_blocks, memory_bytes=kv_cache_memory,
                              poison=poison_from_env() if poison_kv_cache is None else bool(poison_kv_cache))
        if watermark_blocks >= self.pool.num_blocks:
            raise InvalidArgumentError(f"watermark_blocks must be below the pool's {self.pool.num_blocks} "
                                       f"blocks (it would admit nothing), got {watermark_blocks}")
        self.allocator = allocator
        self.enable_prefix_caching = bool(enable_prefix_caching) and allocator == "paged"
        num_host_blocks = offload_bytes // self.pool.bytes_per_block  # (less than a block: no tier)
        self.offload_pool = HostBlockPool(self.pool, num_host_blocks) if num_host_blocks else None
        if allocator == "paged":
            self.block_manager = BlockManager(self.pool.num_blocks, self.block_size,
                                              enable_prefix_caching=self.enable_prefix_caching,
                                              num_host_blocks=num_host_blocks)
        else:
            self.block_manager = ContiguousBlockManager(self.pool.num_blocks, self.block_size,
                                                        max_seq_len=self.max_model_len, policy="max")
        self.preemption_mode = preemption_mode
        self.host_pool = None  # swap mode's host tier
        host_allocator = None
        if preemption_mode == "swap":
            self.host_pool = HostBlockPool(self.pool, swap_bytes // self.pool.bytes_per_block)
            host_allocator = HostBlockAllocator(self.host_pool.num_blocks)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            stop=StopRule(frozenset(cfg.eos_token_ids), self.max_model_len),
            prefix_caching=self.enable_prefix_caching, policy=policy, watermark_blocks=watermark_blocks,
            preemption_mode=preemption_mode, host_allocator=host_allocator)
        self.check_invariants = bool(check_invariants)
        self.batch_invariant = bool(batch_invariant)
        if tp == 1:
            self.executor = ModelExecutor(self.model, self.pool, self.block_manager, self.block_size,
                                          batch_invariant=self.batch_invariant)
        else:
            from pagedbench.refengine.parallel.executor import start_tensor_parallel

            self.executor = start_tensor_parallel(model, self.model, self.pool, self.block_manager,
                                                  self.block_size, tp, seed=seed)
        self.executor.host_pool = self.host_pool
        self.executor.offload_pool = self.offload_pool
        self.core = EngineCore(self.scheduler, self.executor, clock=WallClock(), can_fork=allocator == "paged",
                               seed=seed, make_generator=self.executor.make_generator,
                               rewind_generator=self.executor.rewind_generator)
        self._recorder = StatsRecorder()
        self._stop_strings = StopStringWatcher(self.tokenizer)

    # --- public ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also at interpreter exit). The engine
        cannot step afterwards."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def stats(self) -> LLMStats:
        """A frozen snapshot of the KV pool and the engine's counters since construction."""
        return self._recorder.snapshot(self.block_manager, self.scheduler)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 strict: bool = False, use_tqdm: bool | None = None,
                 max_step_retries: int = 0) -> list[RequestOutput]:
        """Serve ``prompts`` (a list of token-id lists, or of strings when the model has a tokenizer).

        ``sampling_params``: one for every prompt, or a list with one per prompt (None = defaults).
        Returns one RequestOutput per prompt, in order; see the module docstring for bad requests and
        failed steps. ``max_step_retries``: how many failed steps a request may be part of and still be
        served (0: the first aborts it with ``error`` set). ``use_tqdm``: a progress bar on stderr
        (finished requests, output tokens/s); None shows it for more than 8 requests, False never.
        """
        if isinstance(max_step_retries, bool) or not isinstance(max_step_retries, int) or max_step_retries < 0:
            raise InvalidArgumentError(f"max_step_retries must be an int >= 0, got {max_step_retries!r}")
        start = self.core.clock.now()
        prompts, params = self.normalise_prompts(prompts, sampling_params)
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params)]
        bad = [(i, r) for i, r in enumerate(requests) if r.error is not None]
        if strict and bad:
            listing = "; ".join(f"prompt {i}: {r.error}" for i, r in bad)
            raise InvalidRequestError(f"{len(bad)} of {len(requests)} requests rejected: {listing}")
        self._recorder.requests(len(requests) - len(bad), len(bad))
        for r in requests:
            if r.error is None:
                self._queue(r)
        bar = None
        if wants_bar(use_tqdm, len(requests)):
            bar = GenerateProgress(requests, lambda: self._recorder.generated)
        failures: dict[int, int] = {}  # request id -> failed steps it was part of
        try:
            while self.scheduler.has_unfinished():
                try:
                    report = self.core.step()
                except Exception as exc:  # the step was rolled back
                    finished = self._after_failed_step(exc, failures, max_step_retries)
                else:  # a broken invariant is no step failure: it propagates
                    finished = self._after_step(report)
                if bar is not None:
                    bar.update(finished)
        except BaseException:
            self.core.abort_all()  # Ctrl-C, SystemExit: no request or block left behind
            raise
        finally:
            if bar is not None:
                bar.close()
            self._recorder.elapsed(self.core.clock.now() - start)
        self._check_no_leak()
        return [r.output(self.tokenizer) for r in requests]

    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> Request:
        """Validate one prompt (any form :meth:`generate` takes) and queue it without stepping: the entry
        of an online front (``engine/async_llm.py``) that steps with :meth:`step` as requests come.

        Returns its :class:`Request` (``request_id``, ``children``; ``output()`` once finished). A bad
        request comes back with ``error`` set and is not queued: it changes nothing but the id counter.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidArgumentError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        req = self._make_request(prompt, sampling_params)
        if req.error is not None:
            self._recorder.requests(0, 1)
            return req
        self._recorder.requests(1, 0)
        self._queue(req)
        return req

    def _queue(self, req: Request) -> None:
        self._recorder.prompt_tokens(len(req.prompt_token_ids))
        self.core.add(req)
        self._stop_strings.watch(req.children)

    def _after_failed_step(self, exc: Exception, failures: dict[int, int], max_retries: int) -> list[Sequence]:
        """Count a failed step against the requests it touched (every queued one when it touched none,
        e.g. planning failed at its first admission) and abort those out of retries; returns their
        sequences."""
        core = self.core
        touched = {s.request_id for s in core.rolled_back} or set(core.requests)
        why = f"a step failed: {type(exc).__name__}: {exc}"
        ended: list[Sequence] = []
        for rid in sorted(touched):
            failures[rid] = failures.get(rid, 0) + 1
            req = core.requests.get(rid)
            if req is not None and failures[rid] > max_retries:
                req.error = why
                core.abort(rid)
                ended.extend(req.children)
        return ended

    def abort(self, request_id: int) -> bool:
        """Abort request ``request_id`` in any state (waiting, preempted, running, mid-prefill): its
        blocks are freed now and its completions end with ``finish_reason="abort"``, keeping the
        tokens generated so far (``Request.output()``). Returns False when it was not queued (already
        finished or aborted, or never added); an id this engine never issued is an error."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise InvalidArgumentError(f"request_id must be an int, got {type(request_id).__name__}")
        if not 0 <= request_id < self.core.next_request_id:
            raise InvalidArgumentError(
                f"unknown request_id {request_id}: this engine issued ids 0..{self.core.next_request_id - 1}")
        return self.core.abort(request_id)

    def abort_all(self) -> None:
        """Abort every queued request (see :meth:`abort`)."""
        self.core.abort_all()

    def beam_search(self, prompts, params: BeamSearchParams, *, use_tqdm: bool | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search over ``prompts`` (as :meth:`generate` takes them); one BeamSearchOutput per prompt,
        its sequences best first (:mod:`~pagedbench.refengine.engine.beam_search` gives the rules).

        Raises InvalidArgumentError for params that are not BeamSearchParams (beam search honours no
        sampling option: ``n``, ``top_p``, seeds...) or an allocator that cannot fork, and
        InvalidRequestError listing every prompt it cannot serve, before running anything.
        """
        from pagedbench.refengine.engine.beam_search import run_beam_search

        del use_tqdm  # accepted for vLLM's signature; the search shows no bar
        return run_beam_search(self, prompts, params)

    def step(self) -> list[Sequence]:
        """Run one engine step; returns the sequences that finished in it. A step that raises is rolled
        back first (its requests stay queued), so the caller may step on."""
        start = self.core.clock.now()
        try:
            return self._after_step(self.core.step())
        finally:
            self._recorder.elapsed(self.core.clock.now() - start)

    def _after_step(self, report: StepReport) -> list[Sequence]:
        self._recorder.step(report.output, len(report.sampled), self.scheduler, self.block_manager)
        finished = list(report.finished)
        if len(self._stop_strings):
            stopped = [s for s in self._stop_strings.check(self.scheduler.finish_now) if s not in finished]
            self.core.record_finished(stopped, report.end_s)
            finished.extend(stopped)
        if self.check_invariants:
            self.block_manager.check_invariants()
        return finished

    # --- requests ----------------------------------------------------------------------------------
    def normalise_prompts(self, prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        """``(prompts, one SamplingParams per prompt)`` as :meth:`generate` reads its arguments; raises
        InvalidArgumentError for a malformed call (a flat list of ints, a count mismatch...)."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidArgumentError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            raise InvalidArgumentError("prompts is a flat list of ints: pass a list of prompts, e.g. [ids]")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, BeamSearchParams):
            raise InvalidArgumentError("generate takes SamplingParams; for BeamSearchParams call beam_search")
        if isinstance(sampling_params, SamplingParams):
            return list(prompts), [sampling_params] * len(prompts)
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise InvalidArgumentError(
                f"sampling_params: one per prompt expected ({len(prompts)}), got {len(params)}")
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise InvalidArgumentError(
                    f"sampling_params[{i}] must be SamplingParams, got {type(sp).__name__}")
        return list(prompts), params

    def _make_request(self, prompt, params: SamplingParams) -> Request:
        body, ids, salt, error = self._prepare(prompt, params)
        text = body if isinstance(body, str) else None
        # (the ids are plain ints in the vocabulary: _tokens and _check_request read each one)
        return self.core.new_request(ids, params, prompt=text, error=error, cache_salt=salt, check_tokens=False)

    def prepare_prompt(self, prompt, params: SamplingParams) -> tuple[list[int], str | None, str | None]:
        """One prompt in any form :meth:`generate` takes, as ``(token ids, cache_salt, error)``; ``error``
        names why the engine would refuse it under ``params`` (None: it would queue it). For fronts that
        build their own requests on this engine (beam search)."""
        return self._prepare(prompt, params)[1:]

    def _prepare(self, prompt, params: SamplingParams) -> tuple[object, list[int], str | None, str | None]:
        body, salt, error = unpack_prompt(prompt)
        ids: list[int] = []
        if error is None:
            ids, error = self._tokens(body)
        if error is None:
            error = self._check_request(ids, params)
        return body, ids, salt, error

    def _tokens(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return [], "a text prompt needs a tokenizer; the model has none (pass token ids)"
            return list(self.tokenizer.encode(prompt).ids), None
        if not isinstance(prompt, (list, tuple)):
            return [], f"a prompt must be a list of token ids or a string, got {type(prompt).__name__}"
        ids = []
        for t in prompt:
            try:
                if isinstance(t, bool):
                    raise TypeError
                ids.append(operator.index(t))
            except TypeError:
                return [], f"token ids must be ints, got {type(t).__name__} {t!r}"
        return ids, None

    def _check_request(self, ids: list[int], params: SamplingParams) -> str | None:
        vocab = self.config.vocab_size
        if not ids:
            return "empty prompt"
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            return f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}"
        if len(ids) > self.max_model_len:
            return f"prompt of {len(ids)} tokens exceeds the maximum length {self.max_model_len}"
        if params.logprobs is not None and params.logprobs > vocab:
            return f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}"
        if params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer; the model has none (use stop_token_ids)"
        if params.n > self.max_num_seqs:
            return f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}"
        held = min(len(ids) + params.max_tokens - 1, self.max_model_len)  # the last token is never stored
        # Against the whole pool, not the blocks free now: a request that fits an idle pool waits for a
        # busy one (the scheduler admits it once blocks are freed); only one no wait can admit is refused.
        # A preempted sequence is re-admitted whole under the watermark, so the watermark counts too.
        contiguous = self.allocator == "contiguous"
        fits = (self.block_manager.can_ever_allocate(held) if contiguous else
                self.block_manager.can_ever_allocate(held, reserve_free_blocks=self.scheduler.watermark_blocks))
        if not fits:
            need = (f"a reservation of max_model_len={self.max_model_len} tokens" if contiguous
                    else f"{held} tokens (prompt + max_tokens - 1)")
            watermark = self.scheduler.watermark_blocks
            kept = f", {watermark} of them kept free by watermark_blocks" if watermark else ""
            return (f"can never fit the KV pool: {need} need more than its {self.pool.num_blocks} blocks of "
                    f"{self.block_size}{kept} ({self.allocator} allocator)")
        return None

    def _check_no_leak(self) -> None:
        check_no_leak(self.block_manager, self.scheduler)

