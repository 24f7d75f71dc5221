"""One implementation's host path, timed in a process of its own: ``python peer_worker.py IMPL``.

Run by :mod:`bench.studies.host_cost.peers` with the interpreter that has the implementation (vLLM's wheel pins
another torch, so it lives in the ``make peers`` venv; nano-vllm is a checkout on ``--nano-vllm``). It
imports nothing of PagedBench unless IMPL is ``pagedbench``, so it runs in any of those interpreters.

Protocol (one JSON object per line): the trace arrives on stdin first
(``{"prompts", "decode_tokens", "block_size", "num_blocks", "prefix_caching", "nano_vllm_path"}``);
the worker answers ``{"ready": true, "measurements": [...]}`` or ``{"ready": false, "reason": ...}``.
Then each ``round`` line runs one round of every measurement on fresh state (admission untimed) and
answers ``{"seconds": {measurement: seconds for every decode step of the trace}}``; ``quit`` ends it.

Measurements, each over ``len(decode_tokens)`` decode steps of every admitted sequence:

* ``kv``: the KV-manager calls its own scheduler makes for one decode token of one sequence
  (ours: ``can_append``, ``append_token``, ``slot``; nano-vllm: ``can_append``, ``may_append``,
  ``hash_blocks`` and the sequence's ``append_token``; vLLM v1: ``allocate_slots(request, 1)``,
  the computed-token count and ``append_output_token_ids``, whose block hasher hashes full blocks).
* ``scheduler``: the scheduler's whole decode step without a model (ours: ``Scheduler.schedule`` and
  ``update`` through the engine loop with a replaying executor; nano-vllm: ``schedule`` and
  ``postprocess``). vLLM's ``Scheduler`` needs a full ``VllmConfig`` and is not driven.
* ``append`` (ours only): ``append_token`` alone for every decode token, the unit the engine's host
  step is judged against (timed in the same rounds, so a machine whose speed drifts moves both alike).
* ``engine`` (ours only): ``LLM`` steps with the model replaced by a stub returning zeros, so
  everything but the forward is timed: scheduler, block manager, block tables and metadata, sampling;
  with no attention layout planned, as on a GPU backend (the step every backend shares).
* ``engine_cpu_layout`` (ours only): the same, the executor also planning the CPU attention backend's
  padded layout (``plan``) as it does once per step on a CPU. That layout is host work too, but only
  the CPU backend has it (decodes bucketed by length, so it builds at most twice the step's keys).
"""

from __future__ import annotations

import gc
import inspect
import json
import sys
import time
import types
from collections.abc import Callable


def _timed(run_steps: Callable[[], None]) -> float:
    gc.collect()
    start = time.perf_counter()
    run_steps()
    return time.perf_counter() - start


# --- PagedBench ------------------------------------------------------------------------------------------
class PagedBench:
    def __init__(self, trace: dict) -> None:
        from pagedbench.refengine import BlockManager  # noqa: F401  (fails early if absent)

        self.t = trace
        self.measurements = ("kv", "append", "scheduler", "engine", "engine_cpu_layout")

    def kv(self) -> float:
        from pagedbench.refengine import BlockManager

        t = self.t
        bm = BlockManager(t["num_blocks"], t["block_size"], enable_prefix_caching=t["prefix_caching"])
        for i, p in enumerate(t["prompts"]):
            bm.allocate(i, p)
        positions = [len(p) for p in t["prompts"]]
        append, can_append, slot = bm.append_token, bm.can_append, bm.slot

        def steps() -> None:
            for step_tokens in t["decode_tokens"]:
                for i, tok in enumerate(step_tokens):
                    if not can_append(i):
                        raise RuntimeError("the pool is sized too small")
                    append(i, tok)
                    slot(i, positions[i])
                    positions[i] += 1

        return _timed(steps)

    def append(self) -> float:
        from pagedbench.refengine import BlockManager

        t = self.t
        bm = BlockManager(t["num_blocks"], t["block_size"], enable_prefix_caching=t["prefix_caching"])
        for i, p in enumerate(t["prompts"]):
            bm.allocate(i, p)
        append = bm.append_token

        def steps() -> None:
            for step_tokens in t["decode_tokens"]:
                for i, tok in enumerate(step_tokens):
                    append(i, tok)

        return _timed(steps)

    def _core(self, executor_factory):
        from pagedbench.refengine import BlockManager, SamplingParams
        from pagedbench.refengine.engine.core import EngineCore
        from pagedbench.refengine.engine.scheduler import Scheduler, StopRule

        t = self.t
        bm = BlockManager(t["num_blocks"], t["block_size"], enable_prefix_caching=t["prefix_caching"])
        sched = Scheduler(bm, max_num_seqs=len(t["prompts"]), max_num_batched_tokens=1 << 30,
                          stop=StopRule(frozenset(), 1 << 30), prefix_caching=t["prefix_caching"])
        core = EngineCore(sched, executor_factory(), can_fork=True)
        params = SamplingParams(max_tokens=len(t["decode_tokens"]) + 2, ignore_eos=True)
        for p in t["prompts"]:
            core.add(core.new_request(p, params))
        return core

    def scheduler(self) -> float:
        from pagedbench.refengine.engine.core import SimulatedExecutor

        t = self.t
        # the prompt step samples the first token, each decode step one more
        replay = {i: [0, *(s[i] for s in t["decode_tokens"]), 0] for i in range(len(t["prompts"]))}
        core = self._core(lambda: SimulatedExecutor(lambda shape: 0.0, replay=replay))
        core.step()  # every prompt, untimed

        def steps() -> None:
            for _ in t["decode_tokens"]:
                core.step()

        return _timed(steps)

    def engine_cpu_layout(self) -> float:
        return self.engine(with_layout=True)

    def engine(self, with_layout: bool = False) -> float:
        import torch
        from pagedbench.refengine import LLM, SamplingParams

        t = self.t
        torch.set_num_threads(1)  # the host path is one thread; more only contend on a small machine
        # a fresh engine every round: no prefix cache left over from the last one
        llm = LLM({"vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                   "torch_dtype": "float32"}, block_size=t["block_size"], num_blocks=t["num_blocks"],
                  enable_prefix_caching=t["prefix_caching"], max_num_seqs=len(t["prompts"]),
                  max_num_batched_tokens=1 << 20)
        hidden, vocab = llm.config.hidden_size, llm.config.vocab_size
        # the stub keeps shapes and dtypes, so the host path around it is the real one; its outputs are
        # views of buffers made once, so that filling logits with zeros is not timed as host work
        num_prompt_tokens = sum(map(len, t["prompts"]))
        hidden_buf, logits_buf = torch.zeros(num_prompt_tokens, hidden), torch.zeros(len(t["prompts"]), vocab)
        if not with_layout:  # the step every backend shares: a GPU backend plans no layout
            llm.executor.plan = None
        llm.model.forward = lambda ids, pos, meta, kv: hidden_buf[:ids.shape[0]]
        llm.model.compute_logits = lambda h: logits_buf[:h.shape[0]]
        params = SamplingParams(max_tokens=len(t["decode_tokens"]) + 1, ignore_eos=True)
        for p in t["prompts"]:
            llm.core.add(llm.core.new_request(p, params))
        llm.step()  # every prompt, untimed

        def steps() -> None:
            for _ in t["decode_tokens"]:
                llm.step()

        seconds = _timed(steps)
        while llm.scheduler.has_unfinished():  # the last token of each request; frees every block
            llm.step()
        return seconds


# --- nano-vllm (a checkout given by path; its package __init__ imports the GPU model runner) ------------
class NanoVllm:
    def __init__(self, trace: dict) -> None:
        import importlib

        path = trace.get("nano_vllm_path")
        if not path:
            raise ImportError("no nano-vllm checkout given (--nano-vllm PATH or PAGEDBENCH_NANO_VLLM)")
        pkg = types.ModuleType("nanovllm")
        pkg.__path__ = [f"{path}/nanovllm"]
        sys.modules["nanovllm"] = pkg
        config = types.ModuleType("nanovllm.config")  # the real one imports transformers for AutoConfig
        config.Config = object
        sys.modules["nanovllm.config"] = config
        self.sequence = importlib.import_module("nanovllm.engine.sequence")
        self.scheduler_mod = importlib.import_module("nanovllm.engine.scheduler")
        self.params_mod = importlib.import_module("nanovllm.sampling_params")
        self.sequence.Sequence.block_size = trace["block_size"]
        self.t = trace
        self.measurements = ("kv", "scheduler")

    def _admitted(self):
        t = self.t
        cfg = types.SimpleNamespace(max_num_seqs=len(t["prompts"]), max_num_batched_tokens=1 << 30, eos=-1,
                                    kvcache_block_size=t["block_size"], num_kvcache_blocks=t["num_blocks"])
        sched = self.scheduler_mod.Scheduler(cfg)
        params = self.params_mod.SamplingParams(max_tokens=len(t["decode_tokens"]) + 2, ignore_eos=True)
        seqs = [self.sequence.Sequence(p, params) for p in t["prompts"]]
        for s in seqs:
            sched.add(s)
        scheduled, is_prefill = sched.schedule()
        if not is_prefill or len(scheduled) != len(seqs):
            raise RuntimeError("nano-vllm did not admit every prompt in one step")
        sched.postprocess(scheduled, [0] * len(scheduled), True)
        return sched, seqs

    def kv(self) -> float:
        sched, seqs = self._admitted()
        bm = sched.block_manager
        can_append, may_append, hash_blocks = bm.can_append, bm.may_append, bm.hash_blocks

        def steps() -> None:
            for step_tokens in self.t["decode_tokens"]:
                for seq, tok in zip(seqs, step_tokens):
                    if not can_append(seq):
                        raise RuntimeError("the pool is sized too small")
                    seq.num_scheduled_tokens = 1
                    may_append(seq)
                    hash_blocks(seq)
                    seq.num_cached_tokens += 1
                    seq.num_scheduled_tokens = 0
                    seq.append_token(tok)

        return _timed(steps)

    def scheduler(self) -> float:
        sched, _ = self._admitted()

        def steps() -> None:
            for step_tokens in self.t["decode_tokens"]:
                scheduled, is_prefill = sched.schedule()
                sched.postprocess(scheduled, step_tokens[: len(scheduled)], is_prefill)

        return _timed(steps)


# --- vLLM v1 (the `make peers` venv) ---------------------------------------------------------------------
class VllmV1:
    def __init__(self, trace: dict) -> None:
        import torch
        from vllm import SamplingParams
        try:
            from vllm.utils.hashing import get_hash_fn_by_name
        except ImportError:  # vLLM before 0.12 kept it in vllm.utils
            from vllm.utils import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        self.t = trace
        hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(trace["block_size"], hash_fn)
        spec = FullAttentionSpec(block_size=trace["block_size"], num_kv_heads=1, head_size=64, dtype=torch.float16)
        self.kv_config = KVCacheConfig(num_blocks=trace["num_blocks"], kv_cache_tensors=[],
                                       kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.manager_cls, self.request_cls, self.params_cls = KVCacheManager, Request, SamplingParams
        # vLLM 0.33 takes the scheduler's and the prefix hash's block sizes apart (both the cache's here,
        # as Scheduler passes them for one attention group)
        accepted = inspect.signature(KVCacheManager.__init__).parameters
        self.block_size_args = {k: trace["block_size"] for k in ("scheduler_block_size", "hash_block_size")
                                if k in accepted}
        self.measurements = ("kv",)

    def kv(self) -> float:
        t = self.t
        kvm = self.manager_cls(self.kv_config, max_model_len=1 << 20, enable_caching=t["prefix_caching"],
                               **self.block_size_args)
        params = self.params_cls(max_tokens=len(t["decode_tokens"]) + 2, ignore_eos=True)
        requests = []
        for i, p in enumerate(t["prompts"]):  # admission as Scheduler.schedule does it for a new request
            req = self.request_cls(str(i), list(p), params, None, None, block_hasher=self.hasher)
            computed, num_computed = kvm.get_computed_blocks(req)[:2]  # vLLM 0.33 adds a third item
            if kvm.allocate_slots(req, len(p) - num_computed, num_computed, computed) is None:
                raise RuntimeError("the pool is sized too small")
            req.num_computed_tokens = len(p)
            req.append_output_token_ids(0)
            requests.append(req)
        allocate = kvm.allocate_slots

        def steps() -> None:
            for step_tokens in t["decode_tokens"]:
                for req, tok in zip(requests, step_tokens):
                    if allocate(req, 1) is None:  # schedule(): one new token per running request
                        raise RuntimeError("the pool is sized too small")
                    req.num_computed_tokens += 1  # _update_after_schedule
                    req.append_output_token_ids(tok)  # update_from_output

        return _timed(steps)


IMPLEMENTATIONS = {"pagedbench": PagedBench, "nano-vllm": NanoVllm, "vllm-v1": VllmV1}


def main() -> None:
    impl_name = sys.argv[1]
    trace = json.loads(sys.stdin.readline())
    try:
        impl = IMPLEMENTATIONS[impl_name](trace)
    except Exception as e:  # any import or set-up failure: the peer cannot run in this interpreter
        print(json.dumps({"ready": False, "reason": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(json.dumps({"ready": True, "measurements": list(impl.measurements)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        seconds = {m: getattr(impl, m)() for m in impl.measurements}
        print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
