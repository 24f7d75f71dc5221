"""The block manager's hypothesis state machine (``conformance/suite/test_block_manager_stateful.py``) run
over both tiers of the prefix cache: a manager with a host tier of 1-6 blocks, whose copies are applied
to the model's KV contents after every call (every store, then every load: the executor's order).

On top of every check of the device-only machine (each prefix hit, a host hit included, serves exactly
this prompt's KV under this salt; rejected calls change nothing, the host tier included; nothing leaks):

* every host entry holds exactly the KV its key names: the content copied into its host block is a
  whole-block prefix whose salt and tokens reproduce the entry's hash;
* ``check_invariants`` covers the tier (accounting, hashes, one content id per hash on both tiers);
* a failed step (an admission whose copies never run, undone) leaves no entry it stored and no block it
  loaded reachable by a later hit, and nothing pinned.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, rule
from pagedbench.conformance.suite.test_block_manager_stateful import PREFIXES, SALTS, BlockManagerMachine
from pagedbench.refengine.errors import OutOfBlocksError
from pagedbench.refengine.kv import prefix_hash
from pagedbench.refengine.kv.block_manager import BlockManager

MUTATORS = ("allocate", "append_token", "fork", "free", "publish_blocks")


class Stepping:
    """The machine's view of a two-tier manager: each call that can evict or hit is a step whose copies
    are applied to the machine's contents (stores, then loads) and committed."""

    def __init__(self, inner: BlockManager, machine: TwoTierMachine) -> None:
        self.inner, self.machine = inner, machine

    def __getattr__(self, name):
        real = getattr(self.inner, name)
        if name not in MUTATORS:
            return real

        def call(*a, **kw):
            try:
                return real(*a, **kw)
            finally:
                self.machine.apply_copies()
        return call


class TwoTierMachine(BlockManagerMachine):
    @initialize(num_blocks=st.integers(1, 8), bs=st.sampled_from([1, 2, 3, 16]), host_blocks=st.integers(1, 6))
    def setup(self, num_blocks, bs, host_blocks):
        self.raw = BlockManager(num_blocks, bs, enable_prefix_caching=True, num_host_blocks=host_blocks)
        self.bm = Stepping(self.raw, self)
        self.bs, self.caching, self.next_id = bs, True, 0
        self.seqs: dict[int, dict] = {}
        self.content: dict[int, tuple] = {}  # device block id -> (salt, tokens up to its last written slot)
        self.host_content: dict[int, tuple] = {}  # host block id -> the content copied into it

    def apply_copies(self) -> None:
        stores, loads = self.raw.take_offload_copies()
        for d, h in stores:
            assert d in self.content, f"device block {d} stored to the host with no KV written"
            self.host_content[h] = self.content[d]
        for h, d in loads:
            assert h in self.host_content, f"host block {h} loaded with no KV stored"
            self.content[d] = self.host_content[h]
        self.raw.commit_offload_step()

    @rule(data=st.data(), p=st.integers(0, len(PREFIXES) - 1), suffix=st.lists(st.integers(0, 9), max_size=3),
          salt=st.sampled_from(SALTS))
    def failed_step(self, data, p, suffix, salt):
        """An admission whose step fails before its copies ran: undone, its table freed."""
        length = data.draw(st.integers(1, max(1, self.raw.num_blocks * self.bs // 2)), label="length")
        tokens = list(PREFIXES[p][:length]) + suffix
        sid = self.next_id
        try:
            hit = self.raw.allocate(sid, tokens, cache_salt=salt, publish=False)
        except OutOfBlocksError:
            return
        self.next_id += 1
        stores, loads = self.raw.take_offload_copies()
        loaded = self.raw.undo_offload_step()
        assert sorted(loaded) == sorted(d for _, d in loads)
        table = self.raw.block_table(sid)
        self.raw.free(sid)
        for d in table[hit // self.bs:] + loaded:  # nothing written in them: the step never ran
            self.content.pop(d, None)
        for _, h in stores:
            self.host_content.pop(h, None)
        assert not self.raw.host_tier.in_step

    @invariant()
    def host_entries_hold_the_kv_their_keys_name(self):
        tier, bs = self.raw.host_tier, self.bs
        for h in tier.hashes():
            e = tier.get(h)
            salt, tokens = self.host_content[e.host_block_id]
            assert len(tokens) % bs == 0 and tuple(tokens[-bs:]) == e.token_ids
            chain = prefix_hash.root_hash(salt)
            for i in range(len(tokens) // bs):
                chain = prefix_hash.block_hash(chain, tuple(tokens[i * bs:(i + 1) * bs]))
            assert chain == h, f"host block {e.host_block_id} holds KV other than its key's"

    def teardown(self):
        super().teardown()
        if hasattr(self, "raw"):
            assert not self.raw.host_tier.in_step
            self.raw.host_tier.check()


def test_two_tier_block_manager_state_machine():
    TwoTierMachine.TestCase.settings = settings(settings.default, max_examples=200, stateful_step_count=50,
                                                deadline=None)
    TwoTierMachine.TestCase().runTest()
