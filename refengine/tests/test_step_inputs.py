"""The executor's persistent block-table rows and vectorised step inputs (``engine.step_inputs``).

Rows must equal the block manager's tables at every step (checked with ``check_block_tables``) through
admission, growth, preemption, forks with copy-on-write and row reuse; and a row is rewritten only when
its table may have changed, not every step.
"""

from __future__ import annotations

import numpy as np
import pytest
from pagedbench.refengine import LLM, SamplingParams, load_model
from pagedbench.refengine.engine.step_inputs import HostBlockTables
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.model.attention_backend import AttentionMetadata

MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
PROMPTS = [[(7 * i + j) % 128 for j in range(n)] for i, n in enumerate((3, 9, 4, 17, 8))]


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, seed=5)


def make_llm(loaded, *, num_rows: int, max_blocks: int, **kw) -> LLM:
    llm = LLM(loaded, check_invariants=True, **kw)
    # a tiny table: the rows must grow and be taken from sequences that left the step
    llm.executor.tables = HostBlockTables(llm.block_manager, llm.block_size, num_rows, max_blocks)
    llm.executor.check_block_tables = True
    return llm


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_rows_follow_preemption_forks_and_copy_on_write(loaded):
    """n=3 children share the prompt's blocks (copy-on-write on append) in a pool small enough to
    preempt; a 2-row table is reused and grown. The tokens equal a roomy run's."""
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    roomy = LLM(loaded, block_size=4, num_blocks=256)
    want = tokens(roomy.generate(PROMPTS, params))
    llm = make_llm(loaded, num_rows=2, max_blocks=1, block_size=4, num_blocks=20, max_num_batched_tokens=8)
    assert tokens(llm.generate(PROMPTS, params)) == want
    assert llm.stats.num_preemptions > 0
    assert llm.executor.tables.table.shape[0] > 2  # grew: a step held more sequences than rows


def test_rows_are_rewritten_only_when_a_table_changes(loaded):
    """Greedy decodes inside a block rewrite nothing: one whole write at admission, then one extension
    per new block (the blocks already in the row are not written again)."""
    block_size, max_tokens = 8, 12
    llm = make_llm(loaded, num_rows=64, max_blocks=16, block_size=block_size, num_blocks=64)
    llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    held = [len(p) + max_tokens - 1 for p in PROMPTS]  # the last token is never stored
    new_blocks = sum(-(-h // block_size) - -(-len(p) // block_size) for h, p in zip(held, PROMPTS))
    assert llm.executor.tables.num_row_writes == len(PROMPTS)
    assert llm.executor.tables.num_row_extends == new_blocks


def test_step_inputs_slot_mapping_and_positions(loaded):
    llm = make_llm(loaded, num_rows=4, max_blocks=4, block_size=4, num_blocks=32, max_num_batched_tokens=5)
    core, tables = llm.core, llm.executor.tables
    for p in PROMPTS[:2]:
        core.add(core.new_request(p, SamplingParams(max_tokens=2, ignore_eos=True)))
    out = llm.scheduler.schedule()
    step = tables.step_inputs(out)
    want_pos, want_slots = [], []
    for c in out.chunks:
        want_pos += range(c.start, c.end)
        want_slots += [llm.block_manager.slot(c.seq.seq_id, p) for p in range(c.start, c.end)]
    assert step.positions.tolist() == want_pos and step.slot_mapping.tolist() == want_slots
    assert step.query_lens.tolist() == [c.num_tokens for c in out.chunks]
    assert step.seq_lens.tolist() == [c.end for c in out.chunks]


def test_step_inputs_slot_mapping_across_block_boundaries(loaded):
    """Chunks that cross block boundaries, and a chunk that resumes a prefill in the middle of a block:
    every token's slot is its own block's id times the block size plus its offset, as the block manager
    says, at every step (a block index or offset off by one moves the tokens next to a boundary)."""
    llm = make_llm(loaded, num_rows=4, max_blocks=4, block_size=4, num_blocks=32, max_num_batched_tokens=11)
    core, tables = llm.core, llm.executor.tables
    seen = []
    compute = tables.step_inputs

    def recording(out):
        step = compute(out)
        want = [llm.block_manager.slot(c.seq.seq_id, p) for c in out.chunks for p in range(c.start, c.end)]
        seen.append(([(c.start, c.end) for c in out.chunks], step.slot_mapping.tolist(), want))
        return step

    tables.step_inputs = recording
    for p in (PROMPTS[3], PROMPTS[1]):  # 17 and 9 tokens: prefills in chunks of up to 11 tokens
        core.add(core.new_request(p, SamplingParams(max_tokens=3, ignore_eos=True)))
    while core.has_unfinished():
        core.step()
    spans = [span for chunks, _, _ in seen for span in chunks]
    assert any(end - start > 1 and start // 4 != (end - 1) // 4 for start, end in spans)  # crosses a boundary
    assert any(start % 4 and end - start > 1 for start, end in spans)  # resumes mid-block
    for chunks, got, want in seen:
        assert got == want, f"step with chunks {chunks}: slot mapping {got}, block manager {want}"


def _meta(tables):
    """Two sequences of 5 and 2 tokens (blocks of 4: two blocks and one), decoding one token each."""
    return AttentionMetadata.from_host(block_tables=np.array(tables, dtype=np.int32), seq_lens=np.array([5, 2]),
                                       query_lens=np.array([1, 1]), slot_mapping=np.array([4 * 3 + 0, 4 * 1 + 1]),
                                       block_size=4, num_blocks=8)


def test_metadata_checks_the_block_ids_in_use_and_ignores_the_rest():
    assert _meta([[2, 3, 0], [1, 0, 0]]).validated
    assert _meta([[2, 3, -1], [1, 99, -5]]).validated  # past each sequence's blocks: anything goes
    with pytest.raises(InvalidArgumentError, match=r"block_tables\[0, 1\] must be a block id in \[0, 8\); got 8"):
        _meta([[2, 8, 0], [1, 0, 0]])
    with pytest.raises(InvalidArgumentError, match=r"block_tables\[1, 0\] must be a block id in \[0, 8\); got -1"):
        _meta([[2, 3, 0], [-1, 0, 0]])
