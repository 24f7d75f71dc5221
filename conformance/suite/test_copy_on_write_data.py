"""Copy-on-write and prefix sharing with real K/V data in a KV store.

A small driver plays the engine: it writes every new token's K/V (fresh ``randn``, never zeros) into
the slots the block manager names, applies the ``(src, dst)`` copies ``append_token`` reports through
``KVStore.copy_blocks``, and remembers what each sequence must read back. Every check is bit-exact
(``torch.equal``) over every layer, K and V. The pool is NaN-poisoned, so a read of a slot nobody wrote
fails too. Without copy-on-write, siblings read each other's tokens (vLLM #1101): these tests fail.
"""

from __future__ import annotations

import math

import pytest
import torch

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 8


class KVStore:
    """Plain-torch KV memory ``[num_layers][num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM]`` float32,
    NaN until written (so a read of an unwritten slot shows). The suite's own store, not our engine's
    ``BlockPool``: checking another project's block manager must not import our kernels."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        self.block_size = block_size
        self.k = [torch.full(shape, math.nan) for _ in range(NUM_LAYERS)]
        self.v = [torch.full(shape, math.nan) for _ in range(NUM_LAYERS)]

    def write_slots(self, layer: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        idx = torch.tensor(slots, dtype=torch.int64)
        self.k[layer].view(-1, NUM_KV_HEADS, HEAD_DIM)[idx] = k
        self.v[layer].view(-1, NUM_KV_HEADS, HEAD_DIM)[idx] = v

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        for k, v in zip(self.k, self.v):
            k[dst], v[dst] = k[src].clone(), v[src].clone()

    def read_sequence(self, layer: int, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(table[: math.ceil(n / self.block_size)], dtype=torch.int64)
        return (self.k[layer][idx].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].clone(),
                self.v[layer][idx].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].clone())


class KVDriver:
    """Writes K/V as an engine would and keeps each sequence's expected dense K/V per layer."""

    def __init__(self, bm, seed: int = 0) -> None:
        self.bm = bm
        self.pool = KVStore(bm.num_blocks, bm.block_size)
        self.gen = torch.Generator().manual_seed(seed)
        # seq -> per layer (k, v), each [num_tokens, NUM_KV_HEADS, HEAD_DIM] float32
        self.expected: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _fresh(self, n: int) -> torch.Tensor:
        return torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=self.gen)

    def write(self, seq: str, start: int) -> None:
        """Compute tokens [start, num_tokens) of ``seq``: new K/V into their slots."""
        n = self.bm.num_tokens(seq)
        slots = [self.bm.slot(seq, p) for p in range(start, n)]
        old = self.expected.get(seq, [(self._fresh(0), self._fresh(0))] * NUM_LAYERS)
        new = []
        for layer in range(NUM_LAYERS):
            k, v = self._fresh(n - start), self._fresh(n - start)
            self.pool.write_slots(layer, slots, k, v)
            new.append((torch.cat([old[layer][0][:start], k]), torch.cat([old[layer][1][:start], v])))
        self.expected[seq] = new

    def allocate(self, seq: str, tokens: list[int], source: str | None = None, **kw) -> int:
        """Allocate and compute the tokens past the cache hit; the hit must read ``source``'s K/V."""
        if source is not None:
            self.expected[seq] = self.expected[source]
        hit = self.bm.allocate(seq, tokens, **kw)
        self.write(seq, hit)
        return hit

    def append(self, seq: str, token: int = 7) -> list[tuple[int, int]]:
        copies = self.bm.append_token(seq, token)
        self.pool.copy_blocks(copies)
        self.write(seq, self.bm.num_tokens(seq) - 1)
        return copies

    def fork(self, parent: str, child: str) -> None:
        self.bm.fork(parent, child)
        self.expected[child] = [(k.clone(), v.clone()) for k, v in self.expected[parent]]

    def read(self, seq: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        table, n = self.bm.block_table(seq), self.bm.num_tokens(seq)
        return [self.pool.read_sequence(layer, table, n) for layer in range(NUM_LAYERS)]

    def check(self, *seqs: str) -> None:
        for seq in seqs:
            for layer, ((k, v), (ek, ev)) in enumerate(zip(self.read(seq), self.expected[seq])):
                assert torch.equal(k, ek) and torch.equal(v, ev), (
                    f"sequence {seq!r} reads wrong K/V in layer {layer}")


@pytest.mark.parametrize("prompt_len", [6, 8], ids=["partial-last-block", "full-last-block"])
def test_fork_diverge_keeps_parent_bit_identical(impl, prompt_len):
    d = KVDriver(impl.block_manager(12, 4))
    d.allocate("A", list(range(prompt_len)))
    parent_before = d.read("A")
    d.fork("A", "B")
    d.fork("A", "C")
    copies_b, copies_c = d.append("B"), d.append("C")
    if prompt_len % 4:  # the shared last block is partial: each writer copies it first
        assert len(copies_b) == len(copies_c) == 1 and copies_b[0][0] == copies_c[0][0]
        src, dst = copies_b[0]
        for layer in range(NUM_LAYERS):  # the copied block's first slots hold exactly the parent's K/V
            used = prompt_len % 4
            assert torch.equal(d.pool.k[layer][dst][:used], d.pool.k[layer][src][:used])
            assert torch.equal(d.pool.v[layer][dst][:used], d.pool.v[layer][src][:used])
    else:
        assert copies_b == copies_c == []
    after = d.read("A")
    for (k0, v0), (k1, v1) in zip(parent_before, after):
        assert torch.equal(k0, k1) and torch.equal(v0, v1), "the parent's K/V changed"
    d.check("A", "B", "C")
    for _ in range(5):  # diverge further, across a block edge; the parent writes too
        d.append("B")
        d.append("A")
        d.check("A", "B", "C")
    d.bm.check_invariants()


def test_prefix_hits_share_physical_blocks_and_serve_identical_kv(impl):
    d = KVDriver(impl.block_manager(12, 4, enable_prefix_caching=True), seed=1)
    prompt = list(range(100, 109))  # 9 tokens: blocks 0, 1 full, block 2 partial
    d.allocate("A", prompt)
    assert d.allocate("B", [*prompt[:8], 5, 6], source="A") == 8  # B computes only tokens 8, 9
    assert d.bm.block_table("B")[:2] == d.bm.block_table("A")[:2]
    d.check("A", "B")
    kb, ka = d.read("B")[0][0], d.read("A")[0][0]
    assert torch.equal(kb[:8], ka[:8]) and not torch.equal(kb[8], ka[8])
    d.bm.free("A")  # A's full blocks stay cached: C is served the same K/V from them
    assert d.allocate("C", [*prompt[:4], 1], source="B") == 4
    assert d.bm.block_table("C")[0] == d.bm.block_table("B")[0]
    d.check("B", "C")
    d.append("B")  # B's partial block is its own: no copy; C keeps reading its K/V
    d.append("C")
    d.check("B", "C")
    d.bm.check_invariants()
