"""Mutants of the real source that no test can kill because they change nothing observable, each with
the reason. Keyed by (file, function, operator, the mutated line with its whitespace collapsed), so an
entry survives line moves but not a change to the line itself (a test checks every entry still matches).

A surviving mutant that is *not* here is a gap in the tests: the mutation check fails on it.
"""

from __future__ import annotations

from pagedbench.conformance.mutation.operators import Mutant

EQUIVALENT: dict[tuple[str, str, str, str], str] = {
    ("kernels/attention.py", "_decode", "stride_assumed_dense",
     "*part_out.contiguous().stride(), *part_lse.stride(), *out.stride(), *lse.stride(),"): (
        "part_out: the launcher allocates it with torch.empty just above (dense, offset 0), so .contiguous() "
        "returns the tensor itself and the strides passed are the same"
    ),
    ("kernels/attention.py", "_decode", "stride_assumed_dense",
     "*part_out.stride(), *part_lse.contiguous().stride(), *out.stride(), *lse.stride(),"): (
        "part_lse: the launcher allocates it with torch.empty just above (dense, offset 0), so .contiguous() "
        "returns the tensor itself and the strides passed are the same"
    ),
    ("kernels/attention.py", "_decode", "stride_assumed_dense",
     "*part_out.stride(), *part_lse.stride(), *out.stride(), *lse.contiguous().stride(),"): (
        "lse: the launcher allocates it with torch.empty just above (dense, offset 0), so .contiguous() "
        "returns the tensor itself and the strides passed are the same"
    ),
    ("kernels/cache_kernels.py", "_to_fp8_e4m3", "compare_boundary",
     "return tl.where(tl.abs(x) > 0.015625, normal, subnormal).to(dtype)"): (
        "at |x| = 2^-6 exactly both branches give x: the normal rounding keeps its bits (no mantissa bits "
        "below the three kept), and 2^-6 is a multiple of the subnormal step 2^-9, which the magic-number "
        "addition rounds to exactly"
    ),
    ("refengine/kv/table_growth.py", "append_tokens", "compare_boundary",
     "if set(map(type, new)) != {int} or min(new) <= 0 or max(new) >= MAX_TOKEN: # at C speed"): (
        "a run holding token 0 then takes the slow path, which checks every token with checked_token_id (0 passes) "
        "and makes the same list of plain ints: the same tokens appended, only slower"
    ),
    ("refengine/engine/scheduler.py", "_admit", "compare_boundary",
     "if size >= 1 and not self._fits_together(group):"): (
        "for a lone waiting sequence the branch sets group, size = group[:1], 1: the values they already hold"
    ),
    ("refengine/kv/decode_rounds.py", "append_token_rounds", "compare_boundary", "if first <= num_rounds:"): (
        "with first == num_rounds the sequence's takes are range(2 * num_rounds * m + i, span, stride) with "
        "span = 2 * num_rounds * m: an empty range, so no take is added and num_takes grows by 0"
    ),
    ("refengine/kv/decode_rounds.py", "append_token_rounds", "compare_boundary", "if upto >= seq.num_computed:"): (
        "when upto equals num_computed the assignment stores the value it already holds"
    ),
    ("refengine/kv/prefix_cache.py", "_publish", "compare_boundary", "if i > upto_blocks:"): (
        "with i == upto_blocks the early return is skipped, but the rest publishes nothing (the loop runs "
        "while i < upto_blocks) and stores back the same num_published, chain hash and chain key"
    ),
    ("refengine/model/sampling.py", "kept_distribution", "compare_boundary", "if bool((top_p <= 1.0).any()):"): (
        "the top-p branch then also runs for a batch whose rows all have top_p == 1, where `keep` is all "
        "true (`| (top_p >= 1.0)`): sorted_probs and their cumulative sum come out unchanged"
    ),
    ("refengine/engine/scheduler.py", "_decodes", "compare_boundary", "return budget, skipped >= 0"): (
        "the flag only lets schedule() skip the pass of _prefill_chunks when no running sequence it visited "
        "has a prompt chunk left; with `>= 0` that pass always runs, and then finds no sequence with more "
        "than one token to compute (or no budget), so it plans nothing: the same chunks, only slower"
    ),
    (
        "refengine/engine/step_update.py",
        "update",
        "compare_boundary",
        "if publish and (chunk.num_tokens >= 1 or end % bs == 0):",
    ): (
        "every chunk has at least one token, so publish_blocks now runs after every chunk; a one-token chunk "
        "that does not end on a block boundary completes no block (every block below end // block_size was "
        "full, and published, when the chunk that filled it ran), so the call publishes nothing and only "
        "raises num_computed to the value it already has"
    ),
    (
        "refengine/engine/step_update.py",
        "update",
        "compare_boundary",
        "if (n - seq.num_prompt_tokens < p.max_tokens and n < max_len and token not in p.stop_token_ids",
    ): (
        "the inline test is only a fast path: when it fails the sequence goes to _finish, whose "
        "_finish_reason checks `n > max_model_len` itself, so a sequence of exactly max_model_len tokens "
        "is not finished either way"
    ),
    (
        "refengine/kv/prefix_cache.py",
        "publish_blocks",
        "compare_boundary",
        "if num_tokens >= seq.num_computed:",
    ): (
        "with num_tokens == num_computed the assignment stores the value num_computed already holds"
    ),
    ("kernels/attention_kernels.py", "_decode_partial_kernel", "drop_inf_guard", "m_safe = m_new"): (
        "decode visits only key tiles of [start, seq_len) (tile_hi = cdiv(num_keys, BLOCK_N)), so every "
        "visited tile holds a key of the sequence and every row's running max is finite there: the guard "
        "only matters for float32 scores that overflow to -inf, where the oracle's answer is out of reach "
        "either way (prefill, whose tiles can miss a row's window, keeps a live guard: "
        "kernels/tests/test_prefill_window_tiles.py)"
    ),
    (
        "kernels/attention_kernels.py",
        "_prefill_kernel",
        "bound_plus_one",
        "hi = tl.where(m_tile * BLOCK_M < (q_len) + 1, hi, lo)",
    ): (
        "a tile starting exactly at q_len holds no query of the sequence: it now visits keys, but every row "
        "fails r_mask, so it stores nothing"
    ),
    ("kernels/attention_kernels.py", "_prefill_kernel", "compare_boundary", "has_keys = l_i >= 0.0"): (
        "every stored prefill row attends at least its own position, whose p = exp(0) = 1, so l_i >= 1 and "
        "`l_i > 0` and `l_i >= 0` agree on every row that is stored (rows outside r_mask are not)"
    ),
    ("refengine/engine/prefix_offload_steps.py", "_undo_offload", "drop_guard", "if False and (not loaded):"): (
        "with no block loaded the loop below runs over an empty set: `loaded.isdisjoint(...)` is true for every "
        "running sequence, so each is skipped and nothing is freed or preempted; the early return only saves "
        "the walk"
    ),
    ("refengine/kv/host_pool.py", "__init__", "compare_boundary",
     "pin = torch.cuda.is_available() and num_blocks >= 0"): (
        "the flag only differs for a pool of 0 blocks: its tensors then hold no element, so pinned or not "
        "nothing is ever copied into or out of them (no host block id exists), and nothing asks whether "
        "they are pinned; on a machine without CUDA the flag is False either way"
    ),
    ("refengine/engine/swap_preemption.py", "_swap_in_groups", "compare_boundary",
     "if need > bm.num_free_blocks or seats + sum(s.seats for s in seqs) >= self.max_num_seqs:"): (
        "the two differ only when the group would fill the seats exactly, which needs every seat it shared "
        "with the running sequences when it was swapped out still taken (nothing is admitted while a group "
        "is out, so the seats can only have emptied). Then no running sequence has ended or been preempted "
        "since, and the only blocks freed are those of the group's own swap-out, less the one the decode "
        "that forced it took (or, when the victim was that decode itself, without the room its last token "
        "needs): fewer than the group needs, so the block test refuses it either way (a swap-in in the "
        "swap-out's own step is refused before this test); not met in 5,000 random small schedules"
    ),
    ("refengine/engine/swap_preemption.py", "_swap_in_groups", "drop_guard",
     "if False and (group in self._swapped_out_step):"): (
        "a group swapped out in this step was swapped out because the step lacked the blocks it now needs "
        "back, and the sequence that lacked them took what the swap-out freed; so the block test refuses it "
        "in the same step either way, and the guard only decides the case where no one else runs (a lone "
        "group that outgrows the whole pool): with the guard the step plans nothing and the scheduler "
        "raises 'made no progress', without it the group falls back to recompute and fails the same way a "
        "step later. LLM.add_request admits a request only if its prompt and max_tokens fit the pool "
        "(can_ever_allocate), so the engine never reaches that case; argued, and not met in 5,000 random "
        "small schedules"
    ),
    ("refengine/engine/swap_preemption.py", "_swap_in_groups", "compare_boundary", "if n >= 0:"): (
        "n = min(seq.num_uncomputed_tokens, budget) with budget > 0 (the loop's condition), and a swapped "
        "sequence always has a token to compute: it was swapped out while a step was planned, when every "
        "running sequence has its last sampled token or the rest of its prompt uncomputed, and nothing "
        "computes it while it is out; so n >= 1 and both tests pass"
    ),
}


def key_of(mutant: Mutant) -> tuple[str, str, str, str]:
    line = mutant.source.splitlines()[mutant.line - 1]
    return (mutant.path, mutant.function, mutant.operator, " ".join(line.split()))


def equivalence_reason(mutant: Mutant) -> str | None:
    return EQUIVALENT.get(key_of(mutant))
