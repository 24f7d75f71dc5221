"""The process's resident memory, which the tests over huge (mostly untouched) tensors record around each
call, so an implementation that copies such a tensor shows."""

from __future__ import annotations

import os
import resource


def rss_mib() -> float:
    """Resident memory of this process now (Linux ``/proc``; else the peak so far), in MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
