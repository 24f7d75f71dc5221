"""Observable state of a block manager, for "a rejected call changes nothing" checks.

Only the public contract (and its documented extensions) is read: block tables, token counts, every
block's ref count, the free count, the order free blocks will be handed out, and the metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable


def snapshot(bm, seq_ids: Iterable[Hashable]) -> dict[str, object]:
    """Everything a caller can observe about ``bm`` given the sequence ids it allocated."""
    ids = list(seq_ids)
    return {
        "tables": {s: bm.block_table(s) for s in ids},
        "num_tokens": {s: bm.num_tokens(s) for s in ids},
        "ref_counts": [bm.ref_count(b) for b in range(bm.num_blocks)],
        "num_free_blocks": bm.num_free_blocks,
        "free_order": bm.free_block_ids(),
        "metrics": dataclasses.asdict(bm.metrics()),
    }


def without_failure_counter(state: dict[str, object]) -> dict[str, object]:
    """The snapshot minus ``failed_allocations`` (the one counter a failed allocation may bump)."""
    out = dict(state)
    out["metrics"] = {k: v for k, v in state["metrics"].items() if k != "failed_allocations"}
    return out
