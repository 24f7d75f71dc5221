"""A hypothesis state machine driving the block manager against a small pure-Python model.

Pools of 1-8 blocks and block sizes 1, 2, 3, 16 make exhaustion and block edges common. Rules:
allocate (a few shared prompt prefixes, salts, publish or not, and an immediate twin of the prompt),
append, fork, free, publish, prefix hits on a live sequence's tokens, and beam search's steps: a
round that forks beams kept several times, frees beams not kept and appends into shared partial blocks
(a refused append fails the round and frees its whole group), and a group preempted at once. The model keeps each
sequence's tokens, salt and table, and, for every physical block, the *content* of the KV written in
it: ``(salt, every token up to the last written slot)``. After every step it checks:

* ``check_invariants()`` passes; tables, token counts and ``ceil(tokens / block_size)`` lengths match;
* every block's ref count equals the number of tables holding it; free + used + cached = total;
* a fresh block was free before (no id handed out twice); tables only grow, and only a reported
  copy-on-write replaces a table's last block; the block just written is held by one table only;
* every prefix hit serves blocks whose content is exactly this prompt's prefix under this salt (no
  stale, unwritten, foreign-salt or colliding KV), and at most ``len(prompt) - 1`` tokens;
* re-allocating a prompt just allocated hits exactly ``(len - 1) // block_size`` of its blocks;
* a rejected call (OutOfBlocksError) changes nothing, and happens only when the blocks are short;
* at the end, freeing everything leaves every block free: nothing leaks.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pagedbench.conformance.gate.block_manager_state import snapshot, without_failure_counter
from pagedbench.refengine.errors import OutOfBlocksError

PREFIXES = (tuple(range(1, 70)), (3,) * 70, (1, 2) * 35)  # shared prompt prefixes (with repeats)
SALTS = (None, "tenant-1", "tenant-2")


class BlockManagerMachine(RuleBasedStateMachine):
    impl = None  # set by the test

    @initialize(num_blocks=st.integers(1, 8), bs=st.sampled_from([1, 2, 3, 16]), caching=st.booleans())
    def setup(self, num_blocks, bs, caching):
        self.bm = self.impl.block_manager(num_blocks, bs, enable_prefix_caching=caching)
        self.bs, self.caching, self.next_id = bs, caching, 0
        self.seqs: dict[int, dict] = {}  # id -> {"tokens", "salt", "table", "computed"}
        self.content: dict[int, tuple] = {}  # block id -> (salt, tokens up to its last written slot)

    # --- helpers ---------------------------------------------------------------------------------
    def refs(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.seqs.values():
            for b in s["table"]:
                out[b] = out.get(b, 0) + 1
        return out

    def write(self, seq: dict, upto: int) -> None:
        """The KV of tokens [0, upto) of ``seq`` is written: record each touched block's content."""
        bs, tokens = self.bs, seq["tokens"]
        for i in range(-(-upto // bs)):
            end = min(upto, (i + 1) * bs)
            b = seq["table"][i]
            if len(self.content.get(b, (None, ()))[1]) < end:
                self.content[b] = (seq["salt"], tuple(tokens[:end]))
        seq["computed"] = max(seq["computed"], upto)

    def rejected(self, call, ids) -> None:
        before = snapshot(self.bm, ids)
        with pytest.raises(OutOfBlocksError):
            call()
        assert without_failure_counter(snapshot(self.bm, ids)) == without_failure_counter(before)

    def do_allocate(self, tokens: list[int], salt, publish: bool) -> int | None:
        n, bs, sid = len(tokens), self.bs, self.next_id
        fits = self.bm.can_allocate(n)
        before_refs = self.refs()
        try:
            hit = self.bm.allocate(sid, tokens, cache_salt=salt, publish=publish)
        except OutOfBlocksError:
            assert not fits, f"{n} tokens fit the free blocks but allocate raised"
            self.rejected(lambda: self.bm.allocate(sid, tokens, cache_salt=salt, publish=publish),
                          list(self.seqs))
            return None
        self.next_id += 1
        table = self.bm.block_table(sid)
        assert hit % bs == 0 and 0 <= hit <= n - 1 and (self.caching or hit == 0)
        for i, b in enumerate(table):
            if i < hit // bs:  # a hit: the KV must be exactly this prompt's prefix under this salt
                assert self.content.get(b) == (salt, tuple(tokens[:(i + 1) * bs])), f"bad hit on block {b}"
            else:  # fresh: it was free, and nothing is written in it yet
                assert before_refs.get(b, 0) == 0, f"block {b} handed out while held"
                self.content.pop(b, None)
        seq = {"tokens": list(tokens), "salt": salt, "table": table, "computed": hit}
        self.seqs[sid] = seq
        if publish:
            self.write(seq, n)
        return hit

    # --- rules -----------------------------------------------------------------------------------
    @rule(data=st.data(), p=st.integers(0, len(PREFIXES) - 1), suffix=st.lists(st.integers(0, 9), max_size=3),
          salt=st.sampled_from(SALTS), publish=st.booleans(), twin=st.booleans(), churn=st.booleans())
    def allocate(self, data, p, suffix, salt, publish, twin, churn):
        if churn and self.seqs:  # a request finishes first: its blocks become free (or cached)
            self.free(data)
        # prompts up to half the pool's slots (a whole pool with the suffix): fits often, not always
        length = data.draw(st.integers(1, max(1, self.bm.num_blocks * self.bs // 2)), label="length")
        tokens = list(PREFIXES[p][:length]) + suffix
        if self.do_allocate(tokens, salt, publish) is None or not twin:
            return
        first = self.seqs[self.next_id - 1]
        hit = self.do_allocate(tokens, salt, True)
        if hit is not None and self.caching and publish:
            k = (len(tokens) - 1) // self.bs
            assert hit == k * self.bs and self.seqs[self.next_id - 1]["table"][:k] == first["table"][:k]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 9))
    def append(self, data, token):
        self.do_append(data.draw(st.sampled_from(sorted(self.seqs))), token)

    def do_append(self, sid: int, token: int) -> bool:
        """Append through the block manager and check it against the model; False: refused (no block)."""
        seq, bs = self.seqs[sid], self.bs
        n, old = len(seq["tokens"]), list(seq["table"])
        shared = n % bs != 0 and self.refs()[old[-1]] > 1
        needs_block = n % bs == 0 or shared
        assert self.bm.can_append(sid) == (not needs_block or self.bm.num_free_blocks > 0)
        before_refs = self.refs()
        try:
            copies = self.bm.append_token(sid, token)
        except OutOfBlocksError:
            assert needs_block and self.bm.num_free_blocks == 0
            self.rejected(lambda: self.bm.append_token(sid, token), list(self.seqs))
            return False
        table = self.bm.block_table(sid)
        if n % bs == 0:
            assert copies == [] and table[:-1] == old and before_refs.get(table[-1], 0) == 0
            self.content.pop(table[-1], None)
        elif shared:
            assert table[:-1] == old[:-1] and copies == [(old[-1], table[-1])]
            assert before_refs.get(table[-1], 0) == 0
            if old[-1] in self.content:
                self.content[table[-1]] = self.content[old[-1]]
            else:
                self.content.pop(table[-1], None)
        else:
            assert copies == [] and table == old
        seq["tokens"].append(token)
        seq["table"] = table
        if seq["computed"] == n:
            self.write(seq, n + 1)
        assert self.bm.ref_count(table[-1]) == 1, "the block just written is shared"
        return True

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), diverge=st.booleans(), token=st.integers(0, 9))
    def fork(self, data, diverge, token):
        sid, child = data.draw(st.sampled_from(sorted(self.seqs))), self.next_id
        self.do_fork(sid)
        if diverge:  # the child samples its own token at once (parallel sampling): copy-on-write
            self.do_append(child, token)

    def do_fork(self, sid: int) -> int:
        child = self.next_id
        self.bm.fork(sid, child)
        parent = self.seqs[sid]
        self.seqs[child] = {**parent, "tokens": list(parent["tokens"]), "table": list(parent["table"])}
        self.next_id += 1
        return child

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 9), min_size=6, max_size=6))
    def beam_step(self, data, tokens):
        """One round of beam search over a group of live sequences: a beam kept k times forks k - 1
        children, a beam not kept is freed at once, then every kept beam appends its token (copy-on-write
        inside a shared partial block). A refused append fails the step: the whole group is freed (the
        engine aborts the request), and nothing may leak."""
        beams = data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, max_size=4, unique=True),
                          label="beams")
        kept = data.draw(st.lists(st.sampled_from(beams), min_size=1, max_size=6), label="kept")
        group, seen = [], set()
        for parent in kept:
            group.append(self.do_fork(parent) if parent in seen else parent)
            seen.add(parent)
        for sid in beams:
            if sid not in seen:
                self.bm.free(sid)
                del self.seqs[sid]
        for sid, token in zip(group, tokens):
            if not self.do_append(sid, token):
                self.free_group(group)
                return

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def preempt_group(self, data):
        """A group preempted (or finished, or aborted): every sequence of it freed in one go."""
        self.free_group(data.draw(st.lists(st.sampled_from(sorted(self.seqs)), min_size=1, unique=True)))

    def free_group(self, sids: list[int]) -> None:
        for sid in sids:
            self.bm.free(sid)
            del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(sid)
        del self.seqs[sid]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def publish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[sid]
        k = data.draw(st.integers(0, len(seq["tokens"])))
        self.bm.publish_blocks(sid, k)
        if k > seq["computed"]:
            self.write(seq, k)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 9), max_size=2))
    def prefix_hit(self, data, suffix):
        src = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]
        length = data.draw(st.integers(1, len(src["tokens"])))
        self.do_allocate(src["tokens"][:length] + suffix, src["salt"], data.draw(st.booleans()))

    # --- checks ----------------------------------------------------------------------------------
    @invariant()
    def state_matches_the_model(self):
        bm, bs = self.bm, self.bs
        bm.check_invariants()
        refs = self.refs()
        for sid, seq in self.seqs.items():
            n = len(seq["tokens"])
            assert bm.block_table(sid) == seq["table"] and bm.num_tokens(sid) == n
            assert len(seq["table"]) == -(-n // bs)
            assert bm.slot(sid, n - 1) == seq["table"][(n - 1) // bs] * bs + (n - 1) % bs
            for b in seq["table"]:  # the model's own consistency: what a table holds is its own prefix
                salt, written = self.content.get(b, (seq["salt"], ()))
                assert salt == seq["salt"] and written == tuple(seq["tokens"][:len(written)])
        ids = range(bm.num_blocks)
        assert [bm.ref_count(b) for b in ids] == [refs.get(b, 0) for b in ids]
        m = bm.metrics()
        assert m.used_blocks == len(refs) and bm.num_free_blocks == bm.num_blocks - len(refs)
        assert m.used_blocks + m.free_blocks + m.cached_blocks == bm.num_blocks
        assert sorted(bm.free_block_ids()) == sorted(set(range(bm.num_blocks)) - set(refs))

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for sid in list(self.seqs):
            self.bm.free(sid)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
        assert [self.bm.ref_count(b) for b in range(self.bm.num_blocks)] == [0] * self.bm.num_blocks
        assert self.bm.metrics().used_blocks == 0 and self.bm.metrics().live_tokens == 0


def test_block_manager_state_machine(impl):
    impl.block_manager(1, 1)  # "not supported" shows as a skip before hypothesis starts
    machine = type("Machine", (BlockManagerMachine,), {"impl": impl})
    machine.TestCase.settings = settings(settings.default, max_examples=300, stateful_step_count=50,
                                         deadline=None)
    machine.TestCase().runTest()
