"""Block manager micro-benchmarks: admitting a batch (allocate, with prefix hashing), decode appends,
freeing it, forking parallel-sampling children. Each checks its end state once, untimed."""

from __future__ import annotations

import pytest
from pagedbench.refengine import BlockManager

pytestmark = pytest.mark.micro

NUM_SEQS, PROMPT_LEN, DECODE_STEPS, BLOCK_SIZE = 64, 200, 32, 16
NUM_BLOCKS = NUM_SEQS * ((PROMPT_LEN + DECODE_STEPS) // BLOCK_SIZE + 2) * 2
PROMPTS = [[(s * 131 + i * 7) % 32000 for i in range(PROMPT_LEN)] for s in range(NUM_SEQS)]


def fresh() -> BlockManager:
    return BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)


def admitted() -> BlockManager:
    bm = fresh()
    for i, p in enumerate(PROMPTS):
        bm.allocate(i, p)
    return bm


def admit(bm: BlockManager) -> BlockManager:
    allocate = bm.allocate
    for i, p in enumerate(PROMPTS):
        allocate(i, p)
    return bm


def decode(bm: BlockManager) -> BlockManager:
    append = bm.append_token
    for step in range(DECODE_STEPS):
        for i in range(NUM_SEQS):
            append(i, step)
    return bm


def free_all(bm: BlockManager) -> BlockManager:
    for i in range(NUM_SEQS):
        bm.free(i)
    return bm


def fork_children(bm: BlockManager) -> BlockManager:
    fork = bm.fork
    for i in range(NUM_SEQS):
        for c in range(1, 4):
            fork(i, (i, c))
    return bm


def test_micro_allocate(run_micro):
    assert admit(fresh()).num_used_blocks == NUM_SEQS * -(-PROMPT_LEN // BLOCK_SIZE)
    run_micro(admit, lambda: (fresh(),))


def test_micro_append(run_micro):
    assert decode(admitted()).num_tokens(0) == PROMPT_LEN + DECODE_STEPS
    run_micro(decode, lambda: (admitted(),))


def test_micro_free(run_micro):
    assert free_all(admitted()).num_used_blocks == 0
    run_micro(free_all, lambda: (admitted(),))


def test_micro_fork(run_micro):
    bm = fork_children(admitted())
    assert bm.block_table((0, 3)) == bm.block_table(0)
    run_micro(fork_children, lambda: (admitted(),))
