"""Linear layers on oneDNN with the weight packed once into its blocked layout, where that is faster.

torch's ``F.linear`` on a CPU calls MKL's sgemm, which repacks the weight into its own panels on every
call. oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``) can take a weight reordered once
(``_reorder_linear_weight``), as vLLM's CPU build does with ``_C::onednn_mm``: measured on a two-core
AMD EPYC at two threads, 1.2–1.5x faster on SmolLM2's layers and 2.5x on its LM head at 32 rows, the same
float64 error. At one thread the two were within ±14% either way. So the choice is measured, per call
site (q/k/v, o, gate/up, down, LM head), on this machine at the engine's thread count::

    site  --choose_paths("auto")-->  time F.linear and oneDNN on the site's weight, 32 rows, interleaved
                                    oneDNN only when at least MIN_SPEEDUP faster; the choice is cached
                                    per (shape, dtype, threads) for the process, so two engines built in
                                    one process run the same arithmetic

A packed copy costs the weight's bytes again (the parameters themselves stay, as views of the fused
tensors and under their checkpoint names). It follows its weight: a new tensor or an in-place write (a
checkpoint load bumps the tensor's version) packs it again before the next call. Only float32 and
bfloat16 weights on a CPU are packed; everything else, and the batch-invariant mode (fixed row tiles of
``F.linear``), keeps ``F.linear``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from pagedbench.refengine.errors import InvalidArgumentError
from torch import nn
from torch.nn import functional as F

#: the call sites of a Llama layer and the model's head, in the order :func:`choose_paths` reports them
SITES = ("qkv", "o", "gate_up", "down", "lm_head")
#: "auto": measure; "torch": F.linear everywhere; "onednn": the packed path wherever it applies
LINEAR_PATHS = ("auto", "torch", "onednn")
#: oneDNN must beat F.linear by this factor to be chosen (below it the difference is noise)
MIN_SPEEDUP = 1.05
#: rows of the timed call: a decode step of a modest batch, where the per-call cost the pack saves shows
PROBE_ROWS = 32
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

_chosen: dict[tuple, dict] = {}  # (out, in, dtype, threads, rows) -> the measurement that decided


def onednn_available() -> bool:
    """Whether this torch has oneDNN and its prepacked linear ops."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES and weight.dim() == 2


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """``weight`` in oneDNN's layout, and what the weight was when it was packed."""

    packed: torch.Tensor
    ptr: int
    version: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def current(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is still the tensor packed here, unwritten since."""
        return (weight.data_ptr() == self.ptr and weight._version == self.version
                and tuple(weight.shape) == self.shape and weight.dtype == self.dtype)


def pack(weight: torch.Tensor) -> PackedWeight:
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    return PackedWeight(packed, weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype)


class LinearPath:
    """One call site's linear: ``F.linear``, or oneDNN on a packed copy of the weight once chosen."""

    __slots__ = ("_pack", "onednn")

    def __init__(self) -> None:
        self.onednn = False
        self._pack: PackedWeight | None = None

    def use(self, onednn: bool, weight: torch.Tensor | None = None) -> None:
        """Choose the path; with ``weight``, pack it now (start-up carries the cost, not the first step)."""
        self.onednn = bool(onednn)
        self._pack = None
        if self.onednn and weight is not None and packable(weight):
            self._pack = pack(weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.onednn or not packable(weight) or x.dtype != weight.dtype:
            return F.linear(x, weight, bias)
        if self._pack is None or not self._pack.current(weight):
            self._pack = pack(weight)
        return torch.ops.mkldnn._linear_pointwise(x, self._pack.packed, bias, "none", [], "")

    def of(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)``, through this path when ``layer`` is a plain ``nn.Linear``: a tensor-parallel
        layer's own forward (its all-reduce) must run as it is."""
        if type(layer) is not nn.Linear:
            return layer(x)
        return self(x, layer.weight, layer.bias)


def seconds_per_call(fn, reps: int) -> float:
    """Mean wall seconds of ``fn()`` over ``reps`` calls, after one call to warm it."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def measure(weight: torch.Tensor, bias: torch.Tensor | None, rows: int = PROBE_ROWS, rounds: int = 3) -> dict:
    """F.linear against the packed path on ``weight``, ``rows`` rows, interleaved, best of ``rounds``;
    cached per (shape, dtype, threads, rows) for the process. Returns the measurement with its choice."""
    key = (*weight.shape, weight.dtype, torch.get_num_threads(), rows)
    if key not in _chosen:
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        packed = pack(weight).packed
        paths = {"torch": lambda: F.linear(x, weight, bias),
                 "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")}
        # enough calls per round for ~10 ms of work, so the timer's resolution does not decide
        reps = max(1, min(50, int(0.01 / max(seconds_per_call(paths["torch"], 1), 1e-6))))
        best = dict.fromkeys(paths, float("inf"))
        with torch.inference_mode():
            for _ in range(rounds):
                for name, fn in paths.items():  # interleaved: a burst of load hits both alike
                    best[name] = min(best[name], seconds_per_call(fn, reps))
        speedup = best["torch"] / best["onednn"]
        _chosen[key] = {"torch_ms": best["torch"] * 1e3, "onednn_ms": best["onednn"] * 1e3,
                        "speedup": speedup, "path": "onednn" if speedup >= MIN_SPEEDUP else "torch"}
    return dict(_chosen[key])


def check_linear_path(value: object) -> str:
    if not isinstance(value, str) or value not in LINEAR_PATHS:
        raise InvalidArgumentError(f"linear_path must be one of {', '.join(LINEAR_PATHS)}; got {value!r}")
    if value == "onednn" and not onednn_available():
        raise InvalidArgumentError("linear_path='onednn' needs a torch built with oneDNN (mkldnn); this one "
                                   "has none")
    return value


def choose_paths(sites: dict[str, tuple[torch.Tensor, torch.Tensor | None]], mode: str) -> dict[str, dict]:
    """The path of each site from its (weight, bias): ``mode`` "torch" or "onednn" as it says (a weight
    oneDNN cannot take stays on torch), "auto" by :func:`measure`. Returns per site ``{"path", ...}`` with
    the timings where measured."""
    mode = check_linear_path(mode)
    chosen = {}
    for site, (weight, bias) in sites.items():
        if mode == "torch" or not packable(weight) or not onednn_available():
            chosen[site] = {"path": "torch"}
        elif mode == "onednn":
            chosen[site] = {"path": "onednn"}
        else:
            chosen[site] = measure(weight, bias)
    return chosen
