"""The executor seam: the same requests, submitted together, get exactly the same schedule from the
simulated executor replaying the real run's tokens as from the real model executor — the same batches,
copy-on-write copies, preemptions and block tables, step for step. What the serving simulator reports
is therefore the real scheduler's behaviour, not a model of it."""

from __future__ import annotations

import pytest
from pagedbench.refengine import LLM, BlockManager, SamplingParams, load_model
from pagedbench.refengine.engine.core import EngineCore, SimClock, SimulatedExecutor, StepShape
from pagedbench.refengine.engine.scheduler import Scheduler, StopRule

MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


class Recording:
    """Wraps an executor; keeps each step's plan (with the block tables it ran on) and its tokens."""

    def __init__(self, inner, block_manager) -> None:
        self.inner, self.bm = inner, block_manager
        self.steps: list[tuple] = []
        self.tokens: dict[int, list[int]] = {}

    def execute(self, out):
        plan = (tuple((c.seq.seq_id, c.start, c.num_tokens, tuple(self.bm.block_table(c.seq.seq_id)))
                      for c in out.chunks),
                tuple((c.src, c.dst) for c in out.copies), out.preempted_seq_ids)
        result = self.inner.execute(out)
        self.steps.append((plan, tuple(sorted(result.sampled.items()))))
        for seq_id, token in result.sampled.items():
            self.tokens.setdefault(seq_id, []).append(token)
        return result


def requests():
    prompts = [[(7 * i + j) % 64 for j in range(n)] for i, n in enumerate((9, 17, 5, 23, 9, 12))]
    prompts[4] = [*prompts[0][:8], 1]  # a prefix hit
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=t, n=k, seed=s)
              for m, t, k, s in ((14, 0.0, 1, None), (9, 1.0, 3, 5), (20, 0.7, 1, None), (6, 0.0, 2, None),
                                 (11, 1.0, 1, 3), (16, 0.0, 1, None))]
    return prompts, params


@pytest.mark.parametrize("policy", ["mixed", "separate"])
@pytest.mark.parametrize("num_blocks", [40, 18])  # 18: tight enough to preempt
def test_simulated_executor_reproduces_the_real_schedule(policy, num_blocks):
    prompts, params = requests()
    llm = LLM(load_model(MODEL, attention_backend="torch", seed=1), block_size=4, num_blocks=num_blocks,
              max_num_seqs=8, max_num_batched_tokens=24, seed=3, policy=policy)
    real = Recording(llm.executor, llm.block_manager)
    llm.core.executor = real
    llm.generate(prompts, params, use_tqdm=False)
    assert real.steps

    bm = BlockManager(num_blocks, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=24, prefix_caching=True, policy=policy,
                      stop=StopRule(frozenset(llm.config.eos_token_ids), llm.max_model_len))
    sim = Recording(SimulatedExecutor(lambda shape: 0.01, replay=real.tokens), bm)
    core = EngineCore(sched, sim, clock=SimClock(), can_fork=True, seed=3)
    for p, sp in zip(prompts, params):
        core.add(core.new_request(p, sp))
    while core.has_unfinished():
        core.step()
    assert sim.steps == real.steps
    assert core.clock.now() == pytest.approx(0.01 * len(real.steps))
    if num_blocks == 18:
        assert any(plan[2] for plan, _ in real.steps), "the tight pool was meant to preempt"
    assert any(plan[1] for plan, _ in real.steps), "parallel sampling was meant to copy on write"


def test_step_shape_splits_prefill_and_decode():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, prefix_caching=False,
                      stop=StopRule(frozenset(), 64))
    core = EngineCore(sched, SimulatedExecutor(lambda s: 0.0), clock=SimClock())
    core.add(core.new_request([1] * 5, SamplingParams(max_tokens=3, ignore_eos=True)))
    core.add(core.new_request([2] * 6, SamplingParams(max_tokens=3, ignore_eos=True)))
    first = core.step().output
    assert StepShape.of(first) == StepShape(((5, 5), (3, 3)), ())  # budget 8: the second prompt chunked
    second = core.step().output
    assert StepShape.of(second) == StepShape(((3, 6),), (6,))  # a decode at context 6, the chunk's rest
