"""Attention metadata recorded from our engine's own scheduler and step-input path.

A scenario is a few requests run through ``refengine``'s :class:`Scheduler` (mixed policy, chunked
prefill) on the :class:`SimulatedExecutor` (no model: filler tokens), with the executor's
:class:`HostBlockTables` building each step's inputs exactly as the model executor does. Every step's
block tables, slot mapping, ``seq_lens``, ``cu_seqlens_q`` and copy-on-write copies are kept, so a suite
can replay them on any implementation: the metadata an engine really hands a kernel, not metadata a
test composed. What such metadata has that composed cases mostly lack:

* several copy-on-write copies of one source block in one step (the children of an ``n > 1`` request
  appending into the last block they share);
* two sequences of one batch reading the same physical blocks (a prefix hit while its donor still
  runs; the children of a fork), step after step;
* tables exactly as wide as the longest sequence needs (no spare column), padded with ``PAD_BLOCK_ID``;
* chunks that start where the last one ended, decodes and prefill chunks in one batch;
* blocks freed by a preemption and handed to other sequences, the preempted one recomputed elsewhere.

Each scenario states the feature it exists for and :func:`record` raises if the run did not show it, so
a change in the scheduler cannot quietly turn a case into an easier one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pagedbench.refengine import BlockManager, SamplingParams
from pagedbench.refengine.engine.core import EngineCore, SimClock, SimulatedExecutor
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule
from pagedbench.refengine.engine.step_inputs import HostBlockTables

FEATURES = ("prefix-hit", "chunked", "fork", "preempt")


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request: its prompt, how many tokens each of its ``n`` samples generates, and the step
    before which it arrives (0: before the first)."""

    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    arrival_step: int = 0


@dataclass(frozen=True, slots=True)
class EngineScenario:
    """Requests and engine limits; ``feature`` (one of :data:`FEATURES`) is what its steps must show."""

    name: str
    feature: str
    block_size: int
    num_blocks: int
    requests: tuple[EngineRequest, ...]
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64

    @property
    def id(self) -> str:
        return f"{self.name},bs={self.block_size},blocks={self.num_blocks}"


@dataclass(frozen=True, slots=True)
class EngineStep:
    """One step's metadata, as the executor computed it (host arrays, S chunks and T tokens).

    ``copies`` int64 ``[C, 2]`` (src, dst) to apply before the step's writes; ``slot_mapping`` int64
    ``[T]``; ``block_tables`` int32 ``[S, max_blocks]``; ``seq_lens`` and ``query_lens`` int64 ``[S]``.
    """

    block_size: int
    copies: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_lens: np.ndarray
    preempted: tuple[int, ...]  # sequence ids preempted while planning this step

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        cu = np.zeros(len(self.query_lens) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(self.query_lens)
        return cu

    @property
    def decode_only(self) -> bool:
        return bool((self.query_lens == 1).all())

    @property
    def shares_blocks(self) -> bool:
        """Whether two sequences of the step read the same physical block."""
        owners: dict[int, int] = {}
        for s, (row, n) in enumerate(zip(self.block_tables.tolist(), self.seq_lens.tolist())):
            for block in row[: -(-n // self.block_size)]:
                if owners.setdefault(block, s) != s:
                    return True
        return False

    @property
    def resumes_chunk(self) -> bool:
        """Whether a chunk of more than one token starts after its sequence's first token."""
        return bool(((self.query_lens > 1) & (self.seq_lens > self.query_lens)).any())


class _Recorder:
    """Wraps the simulated executor: keeps each step's inputs from the executor's step-input path."""

    def __init__(self, inner: SimulatedExecutor, tables: HostBlockTables) -> None:
        self.inner, self.tables = inner, tables
        self.steps: list[tuple] = []

    def execute(self, out):
        step = self.tables.step_inputs(out)
        copies = np.array([(c.src, c.dst) for c in out.copies], dtype=np.int64).reshape(-1, 2)
        self.steps.append((copies, step, tuple(out.preempted_seq_ids)))
        return self.inner.execute(out)


def record(scenario: EngineScenario) -> tuple[EngineStep, ...]:
    """Run ``scenario`` to the end on the simulated executor; its steps' metadata in order. Raises
    AssertionError when the steps do not show ``scenario.feature``."""
    bs = scenario.block_size
    bm = BlockManager(scenario.num_blocks, bs, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=scenario.max_num_seqs, max_num_batched_tokens=scenario.max_num_batched_tokens,
                      prefix_caching=True, stop=StopRule(frozenset(), 10_000))
    recorder = _Recorder(SimulatedExecutor(lambda shape: 0.0), HostBlockTables(bm, bs))
    core = EngineCore(sched, recorder, clock=SimClock(), can_fork=True)
    pending = sorted(scenario.requests, key=lambda r: r.arrival_step)
    step = 0
    while pending or core.has_unfinished():
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            core.add(core.new_request(list(r.prompt), SamplingParams(max_tokens=r.max_tokens, n=r.n,
                                                                     ignore_eos=True)))
        if core.has_unfinished():
            core.step()
        step += 1
    steps = tuple(EngineStep(bs, copies, s.slot_mapping.copy(), s.block_tables.copy(), s.seq_lens.copy(),
                             s.query_lens.copy(), preempted)
                  for copies, s, preempted in recorder.steps)
    if not _shows(scenario.feature, steps):
        raise AssertionError(f"{scenario.id}: no step shows {scenario.feature!r}; the scenario no longer "
                             f"tests what it is named for")
    return steps


def _shows(feature: str, steps: tuple[EngineStep, ...]) -> bool:
    if feature == "prefix-hit":  # a later prompt's chunk reads blocks its donor reads in the same step
        return any(s.shares_blocks and s.resumes_chunk for s in steps)
    if feature == "chunked":
        return any(s.resumes_chunk and not s.decode_only for s in steps)
    if feature == "fork":
        return any(len(s.copies) for s in steps) and any(s.shares_blocks for s in steps)
    if feature == "preempt":
        return any(s.preempted for s in steps)
    raise ValueError(f"feature must be one of {FEATURES}, got {feature!r}")


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple((seed * 7 + 3 * j + 1) % 97 for j in range(n))


#: the scenarios of the family, one per feature, with blocks of 4 (a few tokens span several blocks)
SCENARIOS_BS4 = (
    # request 1 arrives once request 0's prompt is computed and published: it hits its first 2 blocks
    EngineScenario("prefix-hit", "prefix-hit", 4, 24, (
        EngineRequest(_prompt(1, 11), 6),
        EngineRequest((*_prompt(1, 11)[:8], 50, 51, 52), 4, arrival_step=1))),
    # a budget of 6 tokens a step: prompts of 13 and 9 go in chunks beside the decodes
    EngineScenario("chunked-prefill", "chunked", 4, 24, (
        EngineRequest(_prompt(2, 13), 4), EngineRequest(_prompt(3, 9), 3, arrival_step=1)),
        max_num_batched_tokens=6),
    # n=3 children share the prompt's blocks and copy the partial last one as they append; a second
    # request arrives while they decode, so shared blocks also meet a prefill
    EngineScenario("fork-n3", "fork", 4, 32, (
        EngineRequest(_prompt(4, 6), 5, n=3), EngineRequest(_prompt(5, 7), 3, arrival_step=2))),
    # 8 blocks of 4 for three requests that grow to 14-16 tokens each: the newest is preempted and
    # recomputed into whatever blocks are free when it resumes
    EngineScenario("preempt-resume", "preempt", 4, 8, (
        EngineRequest(_prompt(6, 6), 10), EngineRequest(_prompt(7, 5), 10), EngineRequest(_prompt(8, 7), 8))),
)

#: the same four features with blocks of 16, the smallest block vLLM's attention kernels take (multiples
#: of 16), so implementations that refuse blocks of 4 are judged on engine metadata too; prompts and
#: budgets are scaled so that each still shows its feature (``record`` checks)
SCENARIOS_BS16 = (
    # request 1 shares request 0's first 32 prompt tokens (2 full blocks) and arrives once they are published
    EngineScenario("prefix-hit", "prefix-hit", 16, 12, (
        EngineRequest(_prompt(1, 40), 4),
        EngineRequest((*_prompt(1, 40)[:32], 50, 51, 52), 3, arrival_step=1))),
    # a budget of 20 tokens a step: prompts of 45 and 30 go in chunks beside the decodes
    EngineScenario("chunked-prefill", "chunked", 16, 12, (
        EngineRequest(_prompt(2, 45), 3), EngineRequest(_prompt(3, 30), 3, arrival_step=1)),
        max_num_batched_tokens=20),
    # a prompt of 20 (one full block and 4 tokens): its n=3 children copy the partial second block as
    # they append; a second request arrives while they decode
    EngineScenario("fork-n3", "fork", 16, 12, (
        EngineRequest(_prompt(4, 20), 4, n=3), EngineRequest(_prompt(5, 18), 3, arrival_step=2))),
    # 5 blocks of 16 for three requests that grow from one block to two each: one is preempted and
    # recomputed into whatever blocks are free when it resumes
    EngineScenario("preempt-resume", "preempt", 16, 5, (
        EngineRequest(_prompt(6, 14), 8), EngineRequest(_prompt(7, 13), 8), EngineRequest(_prompt(8, 15), 6))),
)

SCENARIOS = SCENARIOS_BS4 + SCENARIOS_BS16
