"""KV memory: the block pool, the paged block manager (free queue, prefix hashes, invariant checks)
and the contiguous baselines (Orca reservations on an arena). Every manager here offers the interface
the scheduler uses (``can_allocate``, ``allocate``, ``append_token``, ``fork``, ``free``...)."""
