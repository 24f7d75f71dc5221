"""Memory saved by sharing blocks between a request's samples, on the real block manager alone."""

from __future__ import annotations

from pagedbench.bench.workloads import Request
from pagedbench.refengine import BlockManager


def sharing_saving(trace: tuple[Request, ...], n: int, block_size: int) -> float:
    """Memory saved by sharing for parallel sampling with ``n`` samples (vLLM paper, Figure 15).

    Each request alone (no memory pressure): its prompt is allocated once and forked ``n - 1`` times
    (:meth:`refengine.BlockManager.fork`); every sample then generates the request's output, one token
    a step. Returns ``1 - (blocks used with sharing) / (blocks n independent copies would use)``, both
    summed over every step of every request (a time average, as in serving).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    shared = independent = 0
    for r in trace:
        blocks_needed = n * -(-r.total_len // block_size)
        bm = BlockManager(blocks_needed, block_size)
        bm.allocate(0, [0] * r.prompt_len)
        for child in range(1, n):
            bm.fork(0, child)
        for step in range(1, r.output_len + 1):
            for s in range(n):
                bm.append_token(s, 0)
            shared += bm.num_used_blocks
            independent += n * -(-(r.prompt_len + step) // block_size)
    return 1.0 - shared / independent
