"""A step is a transaction: a step that raises at any seam (planning, building its inputs, the forward before or
after some layers wrote KV, the copy-on-write block copy, the sampler, the scheduler's update) is rolled
back, and stepping on gives every request exactly the tokens of a fault-free run, seeded sampling
included, with the block manager's invariants and the executor's block tables checked after every step."""

from __future__ import annotations

import pytest
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.engine import model_executor

MODEL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


class Injected(RuntimeError):
    """The fault a test plants."""


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, attention_backend="torch-batched", seed=1)


def workload():
    """Parallel sampling (copy-on-write), a shared prefix (prefix cache), greedy and seeded and derived-seed
    sampling, long enough prompts to be chunked, in a pool tight enough to preempt (see the fault-free run)."""
    a = [(5 * i + 3) % 256 for i in range(11)]
    prompts = [[1, 2, 3, 4, 5], a, [*a[:8], 9, 9], [(7 * i) % 256 for i in range(6)]]
    params = [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=9, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True),  # derived seed
              SamplingParams(n=2, temperature=1.0, top_k=20, seed=7, max_tokens=7, ignore_eos=True)]
    return prompts, params


def make_llm(loaded, **kw) -> LLM:
    kw = {"block_size": 4, "num_blocks": 16, "max_num_batched_tokens": 12, "max_num_seqs": 8, **kw}
    llm = LLM(loaded, check_invariants=True, seed=3, **kw)
    llm.executor.check_block_tables = True
    return llm


class Fault:
    """Raises ``Injected`` the first time its seam is reached while armed (one step at a time)."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = 0

    def hit(self) -> None:
        if self.armed:
            self.armed = False
            self.fired += 1
            raise Injected("planted fault")


def plant(llm: LLM, seam: str, fault: Fault, monkeypatch) -> None:
    """Make ``seam`` of ``llm``'s step call ``fault.hit()`` (after the seam's work where it has any)."""
    if seam == "planning":  # an admission or an append refused half way through the plan
        monkeypatch.setattr(llm.scheduler, "block_manager", Failing(llm.block_manager, fault, before=True,
                                                                    names=("allocate", "append_token")))
    elif seam == "inputs":
        real = llm.executor.tables.step_inputs
        monkeypatch.setattr(llm.executor.tables, "step_inputs", lambda out: (fault.hit(), real(out))[1])
    elif seam == "forward":  # nothing written yet
        real = llm.model.forward
        monkeypatch.setattr(llm.model, "forward", lambda *a: (fault.hit(), real(*a))[1])
    elif seam == "mid-forward":  # the first layer has written its K/V, the last has not
        layer = llm.model.model.layers[-1]
        real = layer.forward
        monkeypatch.setattr(layer, "forward", lambda *a: (fault.hit(), real(*a))[1])
    elif seam == "copy":  # the first copy done, the rest not
        real = llm.pool.copy_blocks

        def copy(pairs):
            real(pairs[:1])
            fault.hit()
            real(pairs[1:])
        monkeypatch.setattr(llm.pool, "copy_blocks", copy)
    elif seam == "sampler":  # every generator has drawn
        real = model_executor.sample_batch
        monkeypatch.setattr(model_executor, "sample_batch", lambda *a: (real(*a), fault.hit())[0])
    elif seam == "update":  # the whole update applied: tokens appended, forks, finishes, publishing
        real = llm.scheduler.update
        monkeypatch.setattr(llm.scheduler, "update", lambda *a: (real(*a), fault.hit())[0])
    elif seam == "mid-update":  # part of the update applied: the first publish done
        monkeypatch.setattr(llm.scheduler, "block_manager", Failing(llm.block_manager, fault, before=False,
                                                                    names=("publish_blocks",)))
    else:
        raise ValueError(seam)


class Failing:
    """The scheduler's view of a block manager whose methods ``names`` call ``fault.hit()`` before or after
    their work (the block manager itself is slotted: its methods cannot be patched)."""

    def __init__(self, inner, fault: Fault, *, before: bool, names: tuple[str, ...]) -> None:
        self.inner, self.fault, self.before, self.names = inner, fault, before, names

    def __getattr__(self, name):
        real = getattr(self.inner, name)
        if name not in self.names:
            return real

        def call(*a, **kw):
            if self.before:
                self.fault.hit()
            result = real(*a, **kw)
            if not self.before:
                self.fault.hit()
            return result
        return call


def serve(llm: LLM, prompts, params, *, fault: Fault | None = None, fail_at: int = -1,
          seam: str = "") -> tuple[list, int]:
    """Each request's completions' tokens and the number of steps that succeeded; the step numbered
    ``fail_at`` (counting every attempt) runs with ``fault`` armed. Checks that nothing leaked."""
    reqs = [llm.core.new_request(p, sp) for p, sp in zip(prompts, params)]
    for r in reqs:
        llm.core.add(r)
    attempt = steps = 0
    while llm.scheduler.has_unfinished():
        if fault is not None:
            fault.armed = attempt == fail_at
        attempt += 1
        try:
            llm.step()
        except Injected:
            llm.block_manager.check_invariants()
            # planning may fail before it gave any sequence a chunk: nothing to roll back then
            assert llm.core.rolled_back or seam == "planning", "a failed step rolled nothing back"
            continue
        steps += 1
        assert steps < 200, "no progress"
    assert llm.stats.num_used_blocks == 0
    outs = [r.output().outputs for r in reqs]
    for c in (c for cs in outs for c in cs):
        if c.logprobs is not None:  # one entry per token, whatever was rolled back or recomputed
            assert [t in e for t, e in zip(c.token_ids, c.logprobs)] == [True] * len(c.token_ids)
    return [[(c.token_ids, c.logprobs and [sorted(e) for e in c.logprobs]) for c in cs] for cs in outs], steps


def fail_at_every_step(new_llm, plant_fault, prompts, params, want, num_steps: int, seam: str,
                       after=None) -> int:
    """Serves the workload once per step number, on a fresh engine from ``new_llm()`` with a :class:`Fault`
    planted by ``plant_fault(llm, fault)`` and armed at that step; asserts the tokens are ``want`` and
    runs ``after(llm)`` (a leak check) each time. Returns how many times the fault fired."""
    fired = 0
    for fail_at in range(num_steps):
        llm = new_llm()
        fault = Fault()
        plant_fault(llm, fault)
        got, _ = serve(llm, prompts, params, fault=fault, fail_at=fail_at, seam=seam)
        assert got == want, f"{seam} failing at step {fail_at}"
        if after is not None:
            after(llm)
        fired += fault.fired
    return fired


@pytest.fixture(scope="module")
def fault_free(loaded):
    prompts, params = workload()
    llm = make_llm(loaded)
    want, steps = serve(llm, prompts, params)
    assert llm.scheduler.num_preemptions > 0, "the workload was meant to preempt"
    return want, steps


SEAMS = ("planning", "inputs", "forward", "mid-forward", "copy", "sampler", "update", "mid-update")


@pytest.mark.parametrize("seam", SEAMS)
def test_a_failed_step_at_every_step_and_seam_changes_no_token(loaded, fault_free, seam, monkeypatch):
    want, num_steps = fault_free
    prompts, params = workload()
    fired = fail_at_every_step(lambda: make_llm(loaded), lambda llm, fault: plant(llm, seam, fault, monkeypatch),
                               prompts, params, want, num_steps, seam)
    # admissions and appends, the copy, the sampler and publishing are reached only in some steps
    least = 2 if seam in ("planning", "copy", "sampler", "mid-update") else num_steps
    assert fired >= least, f"the {seam} fault fired {fired} times in {num_steps} runs"


@pytest.mark.slow
@pytest.mark.parametrize("seam", SEAMS)
@pytest.mark.parametrize("kw", [dict(policy="separate"), dict(allocator="contiguous", num_blocks=64),
                                dict(enable_prefix_caching=False), dict(block_size=8, num_blocks=8),
                                dict(max_num_batched_tokens=3)], ids=str)
def test_faults_under_other_configurations(loaded, seam, kw, monkeypatch):
    prompts, params = workload()
    want, num_steps = serve(make_llm(loaded, **kw), prompts, params)
    fail_at_every_step(lambda: make_llm(loaded, **kw), lambda llm, fault: plant(llm, seam, fault, monkeypatch),
                       prompts, params, want, num_steps, seam)


def test_a_failed_copy_on_write_copy_does_not_change_the_tokens(loaded, monkeypatch):
    """A copy the failed step planned and never ran: child 0 diverged when the next step read its
    table pointing at the uncopied block."""
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)

    def run(fail: bool) -> list[list[int]]:
        llm = LLM(loaded, block_size=4, num_blocks=64)
        req = llm.core.new_request([1, 2, 3, 4, 5], params)
        llm.core.add(req)
        llm.step()
        if fail:
            with monkeypatch.context() as m:
                m.setattr(llm.pool, "copy_blocks", lambda pairs: _armed().hit())
                with pytest.raises(Injected):
                    llm.step()
        while llm.scheduler.has_unfinished():
            llm.step()
        llm.block_manager.check_invariants()
        assert llm.stats.num_failed_steps == int(fail)
        assert ("1 failed steps" in str(llm.stats)) == fail
        return [c.token_ids for c in req.output().outputs]

    assert run(True) == run(False)


def _armed() -> Fault:
    fault = Fault()
    fault.armed = True
    return fault
