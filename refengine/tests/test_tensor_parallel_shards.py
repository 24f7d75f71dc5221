"""The cut of a model into tensor-parallel shards, without processes: N threads each run one shard of the
same model, meeting in an in-memory all-reduce, over paged KV caches of their own.

Every rank must end the step with the unsharded model's hidden states (to rounding), and rank r's cache
must hold exactly KV heads ``[r * Hkv/N, (r+1) * Hkv/N)`` of the unsharded cache: the query heads of a
GQA group read their KV head on the rank that holds it.
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
from pagedbench.refengine import AttentionMetadata, load_model
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.parallel.linear import ColumnParallelLinear, RowParallelLinear, shard_model

BS, NUM_BLOCKS = 4, 12
BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            max_position_embeddings=64, torch_dtype="float32")


class ThreadAllReduce:
    """A sum over ``n`` threads: each adds its tensor in, waits for the others, reads the total back."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=30)
        self.total: torch.Tensor | None = None
        self.lock = threading.Lock()

    def __call__(self, t: torch.Tensor) -> None:
        with self.lock:
            self.total = t.clone() if self.total is None else self.total + t
        self.barrier.wait()
        t.copy_(self.total)
        if self.barrier.wait() == 0:
            self.total = None
        self.barrier.wait()


def caches(model, num_kv_heads: int):
    cfg = model.config
    shape = (NUM_BLOCKS, BS, num_kv_heads, cfg.head_dim)
    return [(torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(cfg.num_hidden_layers)]


def step_inputs(seed: int):
    """Two sequences over shuffled blocks: a 6-token prompt and a 9-token one."""
    gen = np.random.default_rng(seed)
    blocks = gen.permutation(NUM_BLOCKS)
    tables = np.full((2, 3), -1, dtype=np.int32)
    tables[0, :2], tables[1, :3] = blocks[:2], blocks[2:5]
    lens = [6, 9]
    slots = [int(tables[s, p // BS]) * BS + p % BS for s, n in enumerate(lens) for p in range(n)]
    ids = torch.from_numpy(gen.integers(0, 128, sum(lens)))
    pos = torch.tensor([p for n in lens for p in range(n)])
    meta = AttentionMetadata.from_host(block_tables=tables, seq_lens=np.array(lens), query_lens=np.array(lens),
                                       slot_mapping=np.array(slots), block_size=BS, num_blocks=NUM_BLOCKS)
    return ids, pos, meta, slots


def run_sharded(full, world_size: int, ids, pos, meta):
    reduce = ThreadAllReduce(world_size)
    shards = [copy.deepcopy(full) for _ in range(world_size)]
    kv = [caches(full, full.config.num_key_value_heads // world_size) for _ in range(world_size)]
    out: list = [None] * world_size
    errors: list = []

    def rank(r: int) -> None:
        try:
            shard_model(shards[r], r, world_size, reduce)
            out[r] = shards[r].forward(ids, pos, meta, kv[r])
        except BaseException as e:  # (a failed rank must not leave the others at the barrier)
            errors.append(e)
            reduce.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out, kv


@pytest.mark.parametrize("heads,kv_heads,world_size", [(4, 2, 2), (8, 2, 2), (8, 4, 2), (8, 4, 4)],
                         ids=["hq=4,hkv=2,tp=2", "hq=8,hkv=2,tp=2", "hq=8,hkv=4,tp=2", "hq=8,hkv=4,tp=4"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "qkvo-bias"])
def test_shards_give_the_unsharded_result(heads, kv_heads, world_size, bias):
    cfg = dict(BASE, num_attention_heads=heads, num_key_value_heads=kv_heads, attention_bias=bias,
               o_proj_bias=bias)
    full = load_model(cfg, attention_backend="torch-batched", seed=heads + kv_heads).model
    ids, pos, meta, slots = step_inputs(world_size)
    want_kv = caches(full, kv_heads)
    want = full.forward(ids, pos, meta, want_kv)
    got, kv = run_sharded(full, world_size, ids, pos, meta)
    per_rank = kv_heads // world_size
    for r in range(world_size):
        assert torch.equal(got[r], got[0]), f"rank {r}'s hidden states differ from rank 0's"
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
        for layer in range(full.config.num_hidden_layers):
            for which in (0, 1):  # K, V
                mine = kv[r][layer][which].view(-1, per_rank, full.config.head_dim)[slots]
                whole = want_kv[layer][which].view(-1, kv_heads, full.config.head_dim)[slots]
                torch.testing.assert_close(mine, whole[:, r * per_rank:(r + 1) * per_rank], rtol=1e-5, atol=1e-5)


def test_row_parallel_bias_is_added_once():
    full = torch.nn.Linear(6, 3)
    x = torch.randn(5, 6)
    reduce = ThreadAllReduce(2)
    parts = [RowParallelLinear(full, r, 2, reduce) for r in range(2)]
    out: list = [None, None]
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, parts[r](x[:, 3 * r:3 * r + 3])))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(2):
        torch.testing.assert_close(out[r], full(x))


def test_column_parallel_splits_whole_heads():
    full = torch.nn.Linear(4, 3 * 2)  # 3 heads of 2 features
    with pytest.raises(InvalidArgumentError, match=r"num_attention_heads \(3\) is not divisible by "
                                                   r"tensor_parallel_size=2"):
        ColumnParallelLinear(full, 0, 2, features_per_unit=2, what="num_attention_heads")
    full = torch.nn.Linear(3, 8)  # 4 heads of 2 features: rank 1 holds heads 2 and 3, rows 4..7
    part = ColumnParallelLinear(full, 1, 2, features_per_unit=2)
    assert part.out_features == 4
    assert torch.equal(part.weight, full.weight[4:]) and torch.equal(part.bias, full.bias[4:])
