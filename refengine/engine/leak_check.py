"""What :meth:`LLM.generate` checks once every request has ended: nothing is left held on any tier."""

from __future__ import annotations


def check_no_leak(block_manager, scheduler) -> None:
    """Raise RuntimeError naming the leak: a device block still held; a swap host block still held or a
    group still swapped (swap preemption); the prefix cache's host tier not whole (each host block free
    or holding one entry) or a step's copies still pinned there."""
    bm = block_manager
    if bm.num_free_blocks != bm.num_blocks:
        raise RuntimeError(f"KV block leak: {bm.num_blocks - bm.num_free_blocks} of {bm.num_blocks} "
                           "blocks still held after generate")
    host = scheduler.host_allocator
    if host is not None and (host.num_free_blocks != host.num_blocks or scheduler.swapped):
        raise RuntimeError(f"swap host block leak: {host.num_blocks - host.num_free_blocks} of {host.num_blocks} "
                           f"host blocks still held after generate ({len(scheduler.swapped)} groups swapped)")
    tier = getattr(bm, "host_tier", None)
    if tier is not None:
        if tier.in_step:
            raise RuntimeError("host tier leak: a step's copies are still pinned after generate")
        try:
            tier.check()
        except AssertionError as e:
            raise RuntimeError(f"host tier leak: {e}") from None
