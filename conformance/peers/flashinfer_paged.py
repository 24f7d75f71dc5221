"""FlashInfer's paged attention (``flashinfer-python``) behind the adapter: decode, prefill and the state merge.

FlashInfer's kernels are CUDA only (JIT-compiled CUDA, no Triton fallback), so this adapter runs where
there is a CUDA device and FlashInfer is installed, and nowhere else: elsewhere building it raises
:class:`NotSupported` with the reason (:func:`missing`, "needs CUDA"), which the gate reports once as an
environment error and the matrix as a "not supported: needs CUDA" row. ``flashinfer`` is imported only
when the adapter is built on such a machine, so this module imports anywhere.

The cache is handed over as it is: FlashInfer's ``NHD`` layout of a ``(k_cache, v_cache)`` pair is ours,
``[num_blocks, block_size, num_kv_heads, head_dim]`` (FlashInfer says *page* for our *block*). Its CSR
page table is built from our block tables, as vLLM's and SGLang's FlashInfer backends build it::

    indptr[s + 1] = indptr[s] + ceil(seq_len[s] / block_size)
    indices       = block_table[s][:ceil(seq_len[s] / block_size)] for each s
    last_page_len = seq_len[s] - (pages - 1) * block_size             (1 .. block_size)

Decode runs ``BatchDecodeWithPagedKVCacheWrapper``, prefill ``BatchPrefillWithPagedKVCacheWrapper`` with
``causal=True`` (queries aligned to the end of their sequence, as ours are); a sliding window of W keys is
FlashInfer's ``window_left = W - 1`` (an inclusive left bound). Both plan on every call, as an engine
plans once per step. LSEs: FlashInfer's are base 2; the contract's are natural logs, so the adapter
multiplies what FlashInfer returns by ln 2 and divides what it hands to ``merge_state`` by ln 2.

Declared: float16 and bfloat16 (FlashInfer's decode and prefill kernels are instantiated for those), no
split count (it picks its own split-KV plan), not bit-exact batch invariant (that plan depends on the
batch), no zero-length rows (``last_page_len`` must be at least 1). Not yet judged on a GPU here.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys

import torch
from pagedbench.conformance.adapter import Capabilities, Implementation, NotSupported, register
from pagedbench.conformance.gate.environment import version_of
from pagedbench.conformance.peers import default_scale

DISTRIBUTION = "flashinfer-python"
KV_LAYOUT = "NHD"
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's examples' workspace
LN2 = math.log(2.0)


def missing() -> str | None:
    """Why FlashInfer cannot run in this process ("needs CUDA", ...), or None when it can."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("flashinfer") is None:
        return f"needs {DISTRIBUTION} (not installed in {sys.executable})"
    return None


def page_table(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr int32 ``[num_seqs + 1]``, indices int32, last_page_len int32 ``[num_seqs]``), on the tables'
    device: FlashInfer's CSR page table of our block tables (module docstring)."""
    lens = [int(n) for n in seq_lens.tolist()]
    pages = [-(-n // block_size) for n in lens]
    tables = block_tables.to(torch.int32)
    indices = [tables[s, :p] for s, p in enumerate(pages)]
    dev = block_tables.device
    indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=dev)
    last = torch.tensor([n - (p - 1) * block_size for n, p in zip(lens, pages)], dtype=torch.int32, device=dev)
    flat = torch.cat(indices) if indices else torch.empty(0, dtype=torch.int32, device=dev)
    return indptr, flat, last


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's inclusive left bound for a window of ``sliding_window`` keys (-1: no window)."""
    return -1 if sliding_window is None else sliding_window - 1


@register("flashinfer")
class FlashInferPaged(Implementation):
    """FlashInfer BatchDecode/BatchPrefillWithPagedKVCacheWrapper (CUDA), NHD layout"""

    distribution = DISTRIBUTION
    device = torch.device("cuda")
    capabilities = Capabilities(
        supports_num_splits=False,
        zero_length_rows=False,
        batch_invariant=False,
        dtypes=(torch.float16, torch.bfloat16),
    )

    def __init__(self) -> None:
        reason = missing()
        if reason is not None:
            raise NotSupported(reason)
        import flashinfer

        self._flashinfer = flashinfer
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)

    def describe(self) -> dict[str, object]:
        return {
            "device": str(self.device),
            "triton_interpret": False,
            "peer": {self.distribution: version_of(self.distribution)},
            "kernel": type(self).__doc__.strip().splitlines()[0],
        }

    def _refuse_splits(self, num_splits) -> None:
        if num_splits is not None:
            raise NotSupported(f"{self.name} takes no split count")

    def paged_decode(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        *,
        scale=None,
        sliding_window=None,
        num_splits=None,
        out=None,
        return_lse=False,
    ):
        self._refuse_splits(num_splits)
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        indptr, indices, last = page_table(block_tables, seq_lens, block_size)
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, KV_LAYOUT)
        wrapper.plan(
            indptr, indices, last, q.shape[1], num_kv_heads, head_dim, block_size,
            pos_encoding_mode="NONE", window_left=window_left(sliding_window), q_data_type=q.dtype,
            kv_data_type=k_cache.dtype, sm_scale=default_scale(q, scale),
        )  # fmt: skip
        return self._natural_lse(wrapper.run(q, (k_cache, v_cache), out=out, return_lse=return_lse), return_lse)

    def paged_prefill(
        self,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        *,
        scale=None,
        sliding_window=None,
        out=None,
        return_lse=False,
    ):
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        indptr, indices, last = page_table(block_tables, seq_lens, block_size)
        wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, KV_LAYOUT)
        wrapper.plan(
            cu_seqlens_q.to(torch.int32), indptr, indices, last, q.shape[1], num_kv_heads, head_dim, block_size,
            causal=True, sm_scale=default_scale(q, scale), window_left=window_left(sliding_window),
            q_data_type=q.dtype, kv_data_type=k_cache.dtype,
        )  # fmt: skip
        return self._natural_lse(wrapper.run(q, (k_cache, v_cache), out=out, return_lse=return_lse), return_lse)

    def merge_attn_states(self, out_a, lse_a, out_b, lse_b, *, out=None, out_lse=None):
        merged, lse2 = self._flashinfer.merge_state(out_a, lse_a / LN2, out_b, lse_b / LN2)
        lse = lse2 * LN2
        if out is not None:
            out.copy_(merged)
            merged = out
        if out_lse is not None:
            out_lse.copy_(lse)
            lse = out_lse
        return merged, lse

    @staticmethod
    def _natural_lse(result, return_lse: bool):
        if not return_lse:
            return result
        out, lse2 = result
        return out, lse2 * LN2
