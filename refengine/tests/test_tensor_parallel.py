"""``LLM(tensor_parallel_size=2)`` on the CPU: two processes, gloo on 127.0.0.1.

The same greedy tokens as one process, on the tiny model and on a GQA config with biases, through prefix
caching, copy-on-write and preemption; every rank's KV accounting equal to rank 0's after every step;
a worker killed between steps or in the middle of one, or one that stops answering, fails the step with
an error naming it, without a hang; and no worker outlives its engine. Few and small: every test here
starts real processes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.cli import resolve_model
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.parallel import TensorParallelError

pytestmark = pytest.mark.timeout(180)

#: a pool tight enough to preempt, chunked prefills, block_size 4 so that forks share partial blocks
ENGINE = dict(block_size=4, num_blocks=14, max_num_batched_tokens=12, max_num_seqs=6, seed=0)
GQA = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=4, attention_bias=True, o_proj_bias=True, max_position_embeddings=256,
           torch_dtype="float32")
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]  # two whole blocks


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie nobody reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def run(llm: LLM, check=None) -> list[list[list[int]]]:
    """A first request, then (once its prefix is cached) the rest: a shared prefix, an n=2 greedy request
    (its children fork, then copy their shared last block), more than the pool holds at once. Returns
    each request's completions' tokens; ``check()`` runs after every step."""
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    first = llm.add_request([*PREFIX, 1, 2, 3], greedy)
    reqs = [first]
    for _ in range(3):
        llm.step()
        if check is not None:
            check()
    reqs += [llm.add_request([*PREFIX, 4, 5], greedy),
             llm.add_request([7, 8, 9, 10, 11, 12], SamplingParams(n=2, max_tokens=9, ignore_eos=True)),
             llm.add_request([30 + i for i in range(13)], greedy)]
    while llm.scheduler.has_unfinished():
        llm.step()
        if check is not None:
            check()
    return [[c.token_ids for c in r.output(None).outputs] for r in reqs]


@pytest.mark.parametrize("source", ["tiny", "gqa"])
def test_two_ranks_give_one_rank_tokens_and_agree_on_their_pools(source, monkeypatch):
    model = resolve_model("tiny") if source == "tiny" else GQA
    want = run(LLM(model, **ENGINE))
    copies: list = []
    with LLM(model, **ENGINE, tensor_parallel_size=2, check_invariants=True) as llm:
        executor = llm.executor
        pids = executor.workers.pids
        apply = executor.apply_copies
        monkeypatch.setattr(executor, "apply_copies", lambda out: (copies.extend(out.copies), apply(out)))

        def agree() -> None:
            assert executor.rank_mismatches(llm.scheduler.running) == []

        got = run(llm, agree)
        stats = llm.stats
        reports = executor.rank_reports()
    assert got == want
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0 and copies, "the run must preempt, hit and copy"
    assert [r.num_kv_heads for r in reports] == [llm.config.num_key_value_heads // 2] * 2
    assert reports[1].pid == pids[0] and reports[0].num_steps == reports[1].num_steps > 0
    for pid in pids:  # the context manager stopped the workers
        assert gone(pid)
    llm.add_request([1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(TensorParallelError, match=r"^the tensor-parallel group is closed: its workers were stopped"):
        llm.step()


def test_refused_before_anything_starts(monkeypatch):
    tiny = resolve_model("tiny")
    before = multiprocessing.active_children()
    for value, message in [(0, "tensor_parallel_size must be >= 1, got 0"),
                           (-2, "tensor_parallel_size must be >= 1, got -2"),
                           (2.0, "tensor_parallel_size must be an int, got float 2.0"),
                           (True, "tensor_parallel_size must be an int, got bool True"),
                           ("2", "tensor_parallel_size must be an int, got str '2'"),
                           (os.cpu_count() + 1, f"tensor_parallel_size={os.cpu_count() + 1} exceeds the machine's "
                                                f"{os.cpu_count()} CPU cores")]:
        with pytest.raises(InvalidArgumentError, match=f"^{message}"):
            LLM(tiny, tensor_parallel_size=value)
    with pytest.raises(InvalidArgumentError, match="not a LoadedModel"):
        LLM(load_model(tiny), tensor_parallel_size=2)
    with pytest.raises(InvalidArgumentError, match="batch_invariant=True does not support tensor_parallel_size"):
        LLM(tiny, tensor_parallel_size=2, batch_invariant=True)
    monkeypatch.setattr("pagedbench.refengine.parallel.size.available_ranks", lambda is_gpu: 8)
    for changes, tp, message in [(dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1), 2,
                                  "num_attention_heads \\(3\\)"),
                                 (dict(num_key_value_heads=1), 2, "num_key_value_heads \\(1\\)"),
                                 (dict(intermediate_size=97), 2, "intermediate_size \\(97\\)"),
                                 ({}, 3, "num_attention_heads \\(8\\)")]:
        with pytest.raises(InvalidArgumentError, match=f"tensor_parallel_size={tp} must divide the model's {message}"):
            LLM({**GQA, **changes}, tensor_parallel_size=tp)
    assert multiprocessing.active_children() == before  # no worker was started


def test_a_worker_killed_between_steps_fails_the_step_naming_it():
    with LLM(resolve_model("tiny"), **ENGINE, tensor_parallel_size=2) as llm:
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].error is None
        pid = llm.executor.workers.pids[0]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=4))
        assert time.monotonic() - start < 30
        for out in outs:
            assert out.error is not None and f"tensor-parallel rank 1 (pid {pid}) was killed by signal SIGKILL" \
                in out.error, out.error
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        assert gone(pid)


def test_a_worker_that_raises_is_named_with_its_error():
    with LLM(resolve_model("tiny"), **ENGINE, tensor_parallel_size=2) as llm:
        pid = llm.executor.workers.pids[0]
        llm.executor.workers.send_all("no-such-message", None, "in the test")  # the worker raises, then exits 1
        llm.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        deadline = time.monotonic() + 20
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(TensorParallelError, match=rf"^tensor-parallel rank 1 \(pid {pid}\) exited with code 1 "
                                                      r"before the step: RuntimeError: worker rank 1: unknown "
                                                      r"message 'no-such-message'$"):
            llm.step()


def test_a_worker_killed_mid_step_fails_the_step_naming_it():
    with LLM(resolve_model("tiny"), **ENGINE, tensor_parallel_size=2) as llm:
        pid = llm.executor.workers.pids[0]
        calls = []

        def kill_in_second_layer(module, args):  # rank 0 is past layer 0's all-reduces, before layer 1's
            calls.append(1)
            if len(calls) == 3:
                os.kill(pid, signal.SIGKILL)

        llm.model.model.layers[1].register_forward_pre_hook(kill_in_second_layer)
        llm.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
        llm.step()
        llm.step()
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"tensor-parallel rank 1 \(pid {pid}\) was killed by "
                                                      r"signal SIGKILL during the step"):
            llm.step()
        assert time.monotonic() - start < 30
        # the step was rolled back: its sequence waits again, holding no block
        assert llm.scheduler.has_unfinished() and not llm.scheduler.running
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        with pytest.raises(TensorParallelError, match=r"the tensor-parallel group is closed: .*rank 1"):
            llm.step()
        llm.abort_all()
        assert gone(pid)


def test_a_worker_that_stops_answering_fails_the_step_within_the_timeout(monkeypatch):
    monkeypatch.setattr("pagedbench.refengine.parallel.executor.STEP_TIMEOUT_S", 2.0)
    with LLM(resolve_model("tiny"), **ENGINE, tensor_parallel_size=2) as llm:
        pid = llm.executor.workers.pids[0]
        os.kill(pid, signal.SIGSTOP)  # alive, holding its sockets open, never joining the all-reduce
        start = time.monotonic()
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0]
        assert time.monotonic() - start < 30
        assert out.error is not None and ("waited 2 s in an all-reduce during the step for ranks that did not "
                                          f"join it (running but not answering: rank 1 (pid {pid}))") in out.error
        assert gone(pid)  # the group was closed: the stopped worker killed


def test_ctrl_c_mid_step_propagates_and_closes_the_group():
    """The worker is left inside an all-reduce rank 0 will never join: the group cannot go on."""
    with LLM(resolve_model("tiny"), **ENGINE, tensor_parallel_size=2) as llm:
        pid = llm.executor.workers.pids[0]

        def interrupt(module, args):
            raise KeyboardInterrupt

        llm.model.model.layers[1].register_forward_pre_hook(interrupt)
        llm.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
        with pytest.raises(KeyboardInterrupt):
            llm.step()
        assert gone(pid)
        with pytest.raises(TensorParallelError, match=r"closed: tensor-parallel rank 0 \(pid \d+\) failed during "
                                                      r"the step \(KeyboardInterrupt"):
            llm.step()


@pytest.mark.parametrize("ending", ["exit", pytest.param("parent-killed", marks=pytest.mark.slow)])
def test_no_worker_outlives_its_engine(ending):
    """A script that never closes its LLM: the workers go at interpreter exit, or by themselves when the
    engine's process is killed."""
    script = textwrap.dedent("""
        import sys, time
        from pagedbench.refengine import LLM
        from pagedbench.refengine.cli import resolve_model
        llm = LLM(resolve_model("tiny"), block_size=4, num_blocks=8, tensor_parallel_size=2)
        print(llm.executor.workers.pids[0], flush=True)
        if sys.argv[1] == "parent-killed":
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, ending], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONSAFEPATH": "1"})
    try:
        pid = int(proc.stdout.readline())
        if ending == "parent-killed":
            proc.kill()
        proc.wait(60)
        deadline = time.monotonic() + 20
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gone(pid), f"worker {pid} outlived its engine ({ending})"
    finally:
        proc.kill()
        proc.wait(10)


def test_the_cli_runs_two_ranks(capsys):
    from pagedbench.refengine.cli import main

    argv = ["generate", "--model", "tiny", "--prompt-ids", "5,6,7", "--max-tokens", "5"]
    assert main(argv) == 0
    want = capsys.readouterr().out.splitlines()[:2]
    before = multiprocessing.active_children()
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == want
    assert multiprocessing.active_children() == before  # its workers were stopped
    assert main([*argv, "--tensor-parallel-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --tensor-parallel-size must be >= 1; got 0"  # before loading
