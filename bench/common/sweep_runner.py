"""Sweeps of independent points: the local process pool by default, a Ray cluster when given an address.

A point is a pure function of its (picklable) inputs, as :func:`pagedbench.bench.studies.serving.study.run_point`
is: the same inputs give the same result wherever it runs, so a sweep's results do not depend on the
backend, and a point's cache (keyed by the hash of its inputs) stays valid across machines.

``map_points(fn, points)`` runs ``fn`` on each point and returns the results in the points' order
(``imap_points`` yields them in that order as they come, for progress on a long sweep):

- ``address=None`` and no ``RAY_ADDRESS`` in the environment: a :class:`ProcessPoolExecutor` of
  ``workers`` processes (one process: in this process);
- an address (``--address`` on a command line, or ``RAY_ADDRESS``): Ray, connected with
  ``ray.init(address=...)`` (``"auto"``: the cluster this machine belongs to); a Ray instance this
  process already started (``ray.init(num_cpus=2)`` in a test) is used as it is.

Ray is an optional extra (``pip install 'pagedbench[ray]'``; ``dev`` includes it). On a cluster:
``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the others, then any sweep
with ``--address HEAD:6379`` (or ``RAY_ADDRESS=HEAD:6379``) from the head.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor


def ray_address(address: str | None = None) -> str | None:
    """The Ray address to use: ``address``, else ``RAY_ADDRESS``, else None (local processes)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def map_points(fn: Callable, points: Sequence, *, workers: int = 1, address: str | None = None,
               use_ray: bool | None = None) -> list:
    """``[fn(p) for p in points]``, run in parallel (see the module docstring).

    ``use_ray``: None decides by the address (or an already started Ray instance); True or False forces
    the backend.
    """
    return list(imap_points(fn, points, workers=workers, address=address, use_ray=use_ray))


def imap_points(fn: Callable, points: Sequence, *, workers: int = 1, address: str | None = None,
                use_ray: bool | None = None) -> Iterator:
    """:func:`map_points`, yielding each result in the points' order as soon as it and those before it are
    done. Every point is submitted before the first result is yielded; the arguments are checked at the call."""
    points = list(points)
    if type(workers) is not int or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    address = ray_address(address)
    if use_ray is None:
        use_ray = address is not None or _ray_started()
    if use_ray:
        return _map_ray(fn, points, address)
    if workers == 1 or len(points) <= 1:
        return map(fn, points)
    return _map_pool(fn, points, min(workers, len(points)))


def _map_pool(fn: Callable, points: list, workers: int) -> Iterator:
    with ProcessPoolExecutor(workers) as pool:
        yield from pool.map(fn, points)


def _ray_started() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _map_ray(fn: Callable, points: list, address: str | None) -> Iterator:
    try:
        import ray
    except ImportError:
        raise RuntimeError("a Ray address was given but Ray is not installed: pip install 'pagedbench[ray]'") \
            from None
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    remote = ray.remote(fn)
    refs = [remote.remote(p) for p in points]
    return (ray.get(ref) for ref in refs)
