"""Small "outside" implementations for the gate's own tests, loaded with ``--load``.

Pure torch, written here (nothing from ``pagedbench.kernels``), as another project's adapter would be:

* ``outside-nolse``  -- a correct paged decode that declares no LSE (``returns_lse=False``);
* ``outside-aborts`` -- its decode calls ``os.abort()`` (a crash in native code, as a segfault);
* ``outside-hangs``  -- its ``write_kv`` never returns;
* ``outside-sloppy`` -- correct on valid input, but its decode accepts a batch whose sequence count
  does not match (returns zeros), and its ``write_kv`` writes the cache before it raises on bad shapes;
* ``outside-cuda``   -- ``outside-nolse`` built for a CUDA device;
* ``outside-broken-init`` -- its constructor raises.

With ``PAGEDBENCH_TEST_MODULES_FILE`` set, every process that imports this module appends, at exit, one
JSON line to that file: the names in ``sys.modules`` that start with ``pagedbench.kernels`` or
``triton``, and ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time

import torch
from pagedbench.conformance.adapter import Capabilities, Implementation, register


def _record_modules() -> None:
    path = os.environ.get("PAGEDBENCH_TEST_MODULES_FILE")
    if not path:
        return
    loaded = [m for m in sys.modules if m.startswith("pagedbench.kernels") or m == "triton" or m.startswith("triton.")]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"pid": os.getpid(), "modules": loaded,
                            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}) + "\n")


atexit.register(_record_modules)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=None, sliding_window=None, out=None):
    """q ``[S, Hq, D]``, caches ``[NB, BS, Hkv, D]``: float32 softmax per sequence; length 0 gives 0."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    heads = torch.arange(q.shape[1]) // (q.shape[1] // hkv)
    for s, n in enumerate(seq_lens.tolist()):
        lo = 0 if sliding_window is None else max(0, n - sliding_window)
        pos = torch.arange(lo, n)
        slots = block_tables[s, pos // bs].long() * bs + pos % bs
        k = k_cache.reshape(-1, hkv, k_cache.shape[-1])[slots].float()[:, heads]  # [n, Hq, D]
        v = v_cache.reshape(-1, hkv, v_cache.shape[-1])[slots].float()[:, heads]
        if n - lo == 0:
            out[s] = 0
            continue
        p = torch.softmax(torch.einsum("hd,khd->hk", q[s].float(), k) * scale, dim=-1)
        out[s] = torch.einsum("hk,khd->hd", p, v).to(q.dtype)
    return out


@register("outside-nolse")
class NoLse(Implementation):
    capabilities = Capabilities(returns_lse=False)

    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, sliding_window=None,
                     num_splits=None, out=None, return_lse=False):
        return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out)


@register("outside-aborts")
class Aborts(NoLse):
    def paged_decode(self, *args, **kwargs):
        os.abort()


@register("outside-sloppy")
class Sloppy(NoLse):
    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, **kwargs):
        if q.shape[0] != seq_lens.shape[0]:
            return torch.zeros_like(q)  # accepts the mismatch
        return super().paged_decode(q, k_cache, v_cache, block_tables, seq_lens, **kwargs)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        k_cache.view(-1)[0] = 123.0  # writes first ...
        if k.shape[1:] != k_cache.shape[2:] or v.shape != k.shape or slot_mapping.shape[0] != k.shape[0]:
            raise ValueError("k, v and slot_mapping do not match the cache")  # ... then raises
        slots = slot_mapping.long()
        keep = slots >= 0
        k_cache.view(-1, *k_cache.shape[2:])[slots[keep]] = k[keep]
        v_cache.view(-1, *v_cache.shape[2:])[slots[keep]] = v[keep]


@register("outside-hangs")
class Hangs(NoLse):
    """Its ``write_kv`` never returns (a deadlocked kernel, say): only the gate's --timeout ends it."""

    def write_kv(self, *args, **kwargs):
        while True:
            time.sleep(1)


@register("outside-cuda")
class OnCuda(NoLse):
    """Built for a GPU: on a machine without one, the gate must say so once (an environment error)."""

    device = torch.device("cuda")


@register("outside-broken-init")
class BrokenInit(NoLse):
    """Its constructor raises (a missing library, say): the gate must stop before any case."""

    def __init__(self) -> None:
        raise RuntimeError("libmykernels.so: cannot open shared object file")
