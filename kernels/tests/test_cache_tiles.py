"""The cache kernels' grids cover every tile: shapes wide enough that the interpreter's tiles
(``write_kv_tiles``, ``copy_blocks_tile``) give more than one program along every grid axis, checked
element for element against the reference."""

from __future__ import annotations

import torch
from pagedbench.kernels import cache_ops, copy_blocks, reference, write_kv

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 5, 4, 2, 16384  # 32 Ki elements a token, 128 Ki a block


def caches(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def test_write_kv_covers_every_token_and_head_tile():
    block_t, block_hd = cache_ops.write_kv_tiles(NUM_KV_HEADS, HEAD_DIM, interpret=True)
    num_tokens = 2 * block_t + 1
    assert num_tokens > block_t and block_hd < NUM_KV_HEADS * HEAD_DIM  # several programs on both axes
    k_cache, v_cache = caches(1)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    write_kv(k, v, k_cache, v_cache, slots)
    reference.write_kv(k, v, want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_copy_blocks_covers_every_chunk_of_a_block():
    assert cache_ops.copy_blocks_tile(BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM, interpret=True) < (
        BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM)  # a block takes several programs
    k_cache, v_cache = caches(3)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    pairs = torch.tensor([[0, 3], [4, 1]])
    copy_blocks(k_cache, v_cache, pairs)
    reference.copy_blocks(want_k, want_v, pairs)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
