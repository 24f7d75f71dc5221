"""Prefill rows whose first key tile lies wholly outside their sliding window: with more queries per tile
than keys per key tile (128 x 64 under the interpreter at head_dim 128), a late row of a query tile sees
nothing in the tile's first key tile, so its running max is still -inf there and must give p = 0, not
NaN (the ``m_safe`` guard)."""

from __future__ import annotations

import torch
from pagedbench import kernels
from pagedbench.conformance.gate import oracle
from pagedbench.kernels import attention

BS, D, WINDOW, Q_LEN = 16, 128, 16, 128


def test_rows_with_a_first_key_tile_outside_their_window_match_the_oracle():
    tiles = attention.prefill_tiles(1, D, Q_LEN, interpret=True)
    assert tiles.block_m > tiles.block_n + WINDOW  # some row's window starts past the first key tile
    gen = torch.Generator().manual_seed(0)
    num_blocks = Q_LEN // BS + 1
    k = torch.randn(num_blocks, BS, 1, D, generator=gen)
    v = torch.randn(num_blocks, BS, 1, D, generator=gen)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None]
    lens = torch.tensor([Q_LEN], dtype=torch.int32)
    cu = torch.tensor([0, Q_LEN], dtype=torch.int32)
    q = torch.randn(Q_LEN, 1, D, generator=gen)
    ref = oracle.prefill(q, k, v, table, lens, cu, sliding_window=WINDOW)
    out = kernels.paged_prefill(q, k, v, table, lens, cu, sliding_window=WINDOW)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref.out, rtol=1e-5, atol=1e-5)
