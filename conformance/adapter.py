"""The implementation-under-test interface.

The conformance suite never imports kernels or the engine directly: every test receives an
:class:`Implementation` and calls its methods. To put another paged-attention implementation through
the suite, subclass :class:`Implementation`, override what it supports, and register a factory::

    from pagedbench.conformance.adapter import Implementation, register

    @register("mine")
    class Mine(Implementation):
        def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, **kw): ...

Every method that is not overridden raises :class:`NotSupported`, which the suite reports as
"not supported" (a skip with the reason), never as a pass. Signatures follow the ``kernels`` contract;
see ``kernels/__init__.py`` for shapes and dtypes. Set ``device`` to where the implementation wants its
tensors (the suite builds inputs there) and ``capabilities`` to the optional parts of the contract it
supports (:class:`Capabilities`: LSE, block sizes, ``num_splits``, zero-length rows, bit-exact batch
invariance, sliding windows, dtypes, fp8 KV caches with ``k_scale`` / ``v_scale``); the suite then
reports each case that needs something else as "not supported" for that case alone, and judges the rest
(an implementation without LSE still has its outputs checked). Raising :class:`NotSupported` from a
method still works, for what the declarations do not cover.

Then run the gate on it: ``python -m pagedbench.conformance --impl mine --load mypkg.paged_adapter`` (``--load``
imports the module that registers it), or ``pytest conformance -p mypkg.paged_adapter --impl mine``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pagedbench.conformance.capabilities import Capabilities, DispatchBoundaries

__all__ = ["Capabilities", "DispatchBoundaries", "Implementation", "NotSupported", "register"]


class NotSupported(Exception):
    """The implementation does not support this operation or this configuration."""


class Implementation:
    """Base adapter. Override the operations an implementation supports."""

    name: str = "unnamed"
    device: torch.device = torch.device("cpu")
    #: dtypes the implementation claims; cases with other dtypes are "not supported" (kept for adapters
    #: written before ``capabilities``: a case must be in both)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    #: the optional parts of the contract it supports
    capabilities: Capabilities = Capabilities()
    #: False for deliberately broken implementations (the mutation check)
    expected_to_pass: bool = True
    #: False for the mutation check's own implementations: `--help` and "unknown implementation" do not
    #: offer them to a user (they still run when named)
    listed: bool = True

    def describe(self) -> dict[str, object]:
        """What the gate records about where this implementation runs (override to add more)."""
        return {"device": str(self.device)}

    def _unsupported(self, op: str) -> NotSupported:
        return NotSupported(f"{self.name} does not implement {op}")

    # --- attention over the paged KV cache -------------------------------------------------------
    # ``k_scale`` / ``v_scale`` come only with fp8 caches (``Capabilities.fp8_kv_cache``); the defaults take
    # them, so that an fp8 implementation without one of these operations is "not supported" there
    def paged_decode(self, q, k_cache, v_cache, block_tables, seq_lens, *, scale=None,
                     sliding_window=None, num_splits=None, out=None, return_lse=False, k_scale=None,
                     v_scale=None) -> Any:
        raise self._unsupported("paged_decode")

    def paged_prefill(self, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale=None,
                      sliding_window=None, out=None, return_lse=False, k_scale=None, v_scale=None) -> Any:
        raise self._unsupported("paged_prefill")

    def contiguous_decode(self, q, k, v, seq_lens, *, scale=None, out=None) -> Any:
        raise self._unsupported("contiguous_decode")

    # --- combining partial attentions ----------------------------------------------------------------
    def merge_attn_states(self, out_a, lse_a, out_b, lse_b, *, out=None, out_lse=None) -> Any:
        """(out, lse) of the attention over key sets A and B from each part's output and natural-log LSE
        (``kernels.merge_attn_states``); an adapter of a peer with log2 LSEs converts them (x ln 2)."""
        raise self._unsupported("merge_attn_states")

    # --- KV cache writes ---------------------------------------------------------------------------
    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
        raise self._unsupported("write_kv")

    def copy_blocks(self, k_cache, v_cache, pairs) -> None:
        raise self._unsupported("copy_blocks")

    def copy_blocks_between(self, src_k_cache, src_v_cache, dst_k_cache, dst_v_cache, pairs) -> None:
        """Block ``s`` of the source caches into block ``d`` of the destination caches for each ``(s, d)``
        of ``pairs`` (a list of int pairs): the device <-> host copy of swapping and of a host KV tier."""
        raise self._unsupported("copy_blocks_between")

    # --- block accounting --------------------------------------------------------------------------
    def block_manager(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False):
        """A fresh object with the ``refengine.BlockManager`` contract."""
        raise self._unsupported("block_manager")


#: name -> factory; read through :mod:`conformance.registry`, which also loads the built-in ones
_REGISTRY: dict[str, Callable[[], Implementation]] = {}


def register(name: str):
    """Class decorator (or factory decorator) adding an implementation under ``name``."""

    def deco(factory):
        if name in _REGISTRY:
            raise ValueError(f"implementation {name!r} is already registered")
        _REGISTRY[name] = factory
        if isinstance(factory, type):
            factory.name = name
        return factory

    return deco
