"""The batched block copy between two KV pools (swap preemption's device<->host transfer).

``copy_blocks_between(src, dst, pairs)`` copies block ``s`` of ``src`` into block ``d`` of ``dst`` for
every ``(s, d)`` pair, K and V of every layer: per layer one gather (``src[idx]``), one transfer to the
destination's device and one ``index_copy_`` -- never a Python loop over blocks or slots. Pools are given
as their ``kv_caches()`` lists (``(k, v)`` per layer, ``[num_blocks, block_size, num_kv_heads,
head_dim]``), so the device pool's CuPy-backed torch views and the host pool's CPU tensors meet
through torch alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pagedbench.refengine.errors import InvalidArgumentError

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def copy_blocks_between(src: KVCaches, dst: KVCaches, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy ``src`` block ``s`` to ``dst`` block ``d`` for each ``(s, d)`` in ``pairs`` (every layer, K
    and V). Every id is checked first and destinations must be distinct; on bad input nothing is written."""
    if not pairs:
        return
    if len(src) != len(dst):
        raise InvalidArgumentError(f"the pools have {len(src)} and {len(dst)} layers")
    s_ids, d_ids = [p[0] for p in pairs], [p[1] for p in pairs]
    for name, ids, pool in (("source", s_ids, src), ("destination", d_ids, dst)):
        n = pool[0][0].shape[0]
        bad = [b for b in ids if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n]
        if bad:
            raise InvalidArgumentError(f"{name} block ids must be ints in [0, {n}), got {bad[:5]}")
    if len(set(d_ids)) != len(d_ids):
        raise InvalidArgumentError(f"destination blocks must be distinct, got {d_ids}")
    k0, dk0 = src[0][0], dst[0][0]
    if k0.shape[1:] != dk0.shape[1:] or k0.dtype != dk0.dtype:
        raise InvalidArgumentError(f"block shapes differ: {tuple(k0.shape[1:])} {k0.dtype} vs "
                                   f"{tuple(dk0.shape[1:])} {dk0.dtype}")
    s_idx = torch.tensor(s_ids, dtype=torch.int64, device=k0.device)
    d_idx = torch.tensor(d_ids, dtype=torch.int64, device=dk0.device)
    for (sk, sv), (dk, dv) in zip(src, dst):
        # fp8 has no index_copy_ on every backend: move the bytes as uint8 views of the same memory
        for s, d in ((sk, dk), (sv, dv)):
            if s.dtype == torch.float8_e4m3fn:
                s, d = s.view(torch.uint8), d.view(torch.uint8)
            d.index_copy_(0, d_idx, s.index_select(0, s_idx).to(d.device))
