"""Outside implementations behind the adapter: other projects' paged-attention kernels, run as they ship.

* ``vllm_unified``      -- vLLM's ``unified_attention`` (Triton; decode and prefill), registered ``vllm-unified``;
* ``vllm_paged_decode`` -- vLLM's ``chunked_prefill_paged_decode`` decode path (``kernel_paged_attention_2d``),
  registered ``vllm-paged-decode``;
* ``vllm_prefill``      -- vLLM's ``context_attention_fwd`` (the prefix-prefill kernel), registered ``vllm-prefill``;
* ``vllm_cache_write``  -- vLLM's ``triton_reshape_and_cache_flash`` (the KV-cache write), registered
  ``vllm-cache-write``;
* ``vllm_merge``        -- vLLM's Triton ``merge_attn_states`` (cascade's LSE merge), registered ``vllm-merge``;
* ``sglang_decode``     -- SGLang's Triton ``decode_attention_fwd``, registered ``sglang-decode``;
* ``sglang_merge``      -- SGLang's Triton ``merge_state_triton``, registered ``sglang-merge``;
* ``flashinfer_paged``  -- FlashInfer's paged decode/prefill wrappers and ``merge_state`` (CUDA only),
  registered ``flashinfer``.

Their wheels pin torch versions other than ours, so they live in a venv of their own (``make peers``,
installed with ``--no-deps`` against our torch) and the gate runs there: ``.peers/bin/python -m
pagedbench.conformance --impl vllm-unified --load pagedbench.conformance.peers.vllm_unified``.

Importing ``vllm`` or ``sglang`` as packages pulls in their servers' dependencies (``cachetools``,
``tqdm``, ``zmq``, ...), none of which a kernel uses, so :func:`load_kernel_module` loads the one kernel
file by path, with stand-ins for the few modules it imports (a logger, the platform's fp8 dtype, the
Triton re-export). The stand-ins answer as those modules do on a machine without a ROCm GPU. The
kernels themselves run unmodified.

Without a GPU these Triton kernels need Triton's interpreter: :func:`use_interpreter_without_gpu` sets
``TRITON_INTERPRET=1`` before Triton is first imported, in the gate's worker that runs the adapter, and
each adapter records whether it did (``describe()``), so its results say so.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import logging
import math
import os
import sys
import types
from pathlib import Path

import torch
from pagedbench.conformance.adapter import Implementation, NotSupported
from pagedbench.conformance.gate.environment import version_of


def use_interpreter_without_gpu() -> bool:
    """Switch Triton's interpreter on when there is no CUDA device; True when it is on.

    Triton reads ``TRITON_INTERPRET`` when it is imported, so this must run first: an adapter that finds
    Triton already imported without it cannot run these kernels on a CPU and says so.
    """
    if torch.cuda.is_available():
        return os.environ.get("TRITON_INTERPRET") == "1"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set: the peer kernels cannot "
            "run on this CPU-only process"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def _package_dir(package: str) -> Path:
    """The folder of an installed top-level package, found without importing it."""
    loaded = sys.modules.get(package)
    if loaded is not None and getattr(loaded, "__path__", None):  # our empty stand-in, from an earlier load
        return Path(loaded.__path__[0])
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{package} is not installed in this interpreter ({sys.executable})")
    return Path(next(iter(spec.submodule_search_locations)))


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def load_kernel_module(dotted: str, stand_ins: dict[str, dict[str, object]]) -> types.ModuleType:
    """Import the peer module ``dotted`` (e.g. ``vllm.attention.ops.triton_unified_attention``) from its
    installed file, without running its packages' ``__init__`` files.

    Each parent package becomes an empty package whose ``__path__`` is the real folder (so the module's
    relative imports find their real sibling files); ``stand_ins`` maps the other modules it imports to
    their attributes. A module already loaded is returned as is. Triton's interpreter is switched on
    first where there is no GPU (:func:`use_interpreter_without_gpu`).
    """
    use_interpreter_without_gpu()
    if dotted in sys.modules:
        return sys.modules[dotted]
    parts = dotted.split(".")
    root = _package_dir(parts[0])
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            pkg = _stub(name)
            pkg.__path__ = [str(root.joinpath(*parts[1:i]))]
    for name, attrs in stand_ins.items():
        if name not in sys.modules:
            _stub(name, **attrs)
    return importlib.import_module(dotted)


def triton_stand_in() -> dict[str, object]:
    """``vllm.triton_utils``: ``triton`` and ``triton.language`` themselves."""
    use_interpreter_without_gpu()  # before triton's first import
    import triton
    import triton.language as tl

    return {"triton": triton, "tl": tl, "HAS_TRITON": True}


class _NoRocmPlatform:
    """What ``vllm.platforms.current_platform`` answers on a machine that is not ROCm (the kernels ask
    for the fp8 dtype, only to bound fp8 outputs, which these adapters never request, and for the
    device's capability, to pick tile sizes and warps). Without CUDA it answers as an XPU (``is_xpu``)."""

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        return torch.float8_e4m3fn

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def is_cuda() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def has_device_capability(capability) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor >= capability

    @staticmethod
    def get_device_capability():
        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None

    @staticmethod
    def is_device_capability(capability) -> bool:
        return torch.cuda.is_available() and tuple(torch.cuda.get_device_capability()) == tuple(capability)

    @staticmethod
    def is_device_capability_family(major_times_ten: int) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] * 10 == major_times_ten

    @staticmethod
    def is_xpu() -> bool:
        # Off CUDA, the cache-write launcher would ask torch.cuda for the device's capability to pick its
        # warps and stages, and would refuse bfloat16 (SM80+ or an XPU); answering as an XPU takes its
        # other branch, whose launch parameters Triton's interpreter ignores. With CUDA this is False.
        return not torch.cuda.is_available()


class _OnceLogger(logging.LoggerAdapter):
    """``vllm.logger.init_logger``'s logger: ``debug_once`` / ``info_once`` / ``warning_once`` log each
    message once, as vLLM's do."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})
        self._said: set[tuple[str, str]] = set()

    def _once(self, level: str, msg: str, *args, **kwargs) -> None:
        kwargs.pop("scope", None)
        if (level, msg) not in self._said:
            self._said.add((level, msg))
            getattr(self, level)(msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs):
        self._once("debug", msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs):
        self._once("info", msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs):
        self._once("warning", msg, *args, **kwargs)


class KVQuantMode(enum.IntEnum):
    """``vllm.v1.kv_cache_interface.KVQuantMode``'s first members, with its values (the kernels compare
    against them; that module itself imports half of vLLM's configuration)."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


def _is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """As vLLM's: every ``kv_cache_dtype`` but the unquantized ones is quantized."""
    return kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32", "half", "float")


def vllm_stand_ins() -> dict[str, dict[str, object]]:
    """The modules vLLM's attention kernel files import, as they behave off ROCm."""
    return {
        "vllm.logger": {"init_logger": _OnceLogger},
        "vllm.envs": {"VLLM_BATCH_INVARIANT": False},  # vLLM's default: batch invariance off
        "vllm.platforms": {"current_platform": _NoRocmPlatform()},
        "vllm.v1.kv_cache_interface": {"KVQuantMode": KVQuantMode, "is_quantized_kv_cache": _is_quantized_kv_cache},
        "vllm.model_executor.layers.quantization.utils.quant_utils": {
            "FP8_DTYPE": torch.float8_e4m3fn,
            "get_fp8_min_max": lambda: (-448.0, 448.0),  # e4m3fn's range, as off ROCm
        },
        # chunked_prefill_paged_decode asks whether to use ROCm's custom kernel (never, off ROCm) and, since
        # vLLM 0.34, whether the GPU is an RDNA one (for its launch's warps; never, off ROCm)
        "vllm.platforms.rocm": {"use_rocm_custom_paged_attention": lambda *args, **kwargs: False,
                                "on_rdna": lambda: False},
        "vllm.triton_utils": triton_stand_in(),
        "vllm._custom_ops": {},  # only ROCm's custom paged attention is called from it
    }


class PeerImplementation(Implementation):
    """An outside kernel: runs on the GPU when there is one, else on the CPU under Triton's interpreter.

    Subclasses set ``distribution`` (whose version is recorded) and load their kernel in ``__init__``
    after :func:`use_interpreter_without_gpu`.
    """

    distribution: str = ""

    def __init__(self) -> None:
        self.interpreted = use_interpreter_without_gpu()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def describe(self) -> dict[str, object]:
        return {
            "device": str(self.device),
            "triton_interpret": self.interpreted,
            "peer": {self.distribution: version_of(self.distribution)},
            "kernel": type(self).__doc__.strip().splitlines()[0] if type(self).__doc__ else None,
        }


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def refuse_lse(name: str, return_lse: bool) -> None:
    if return_lse:
        raise NotSupported(f"{name} returns no LSE")


def refuse_unread_strides(name: str, dims: int, reads: str, **tensors: torch.Tensor) -> None:
    """Raise :class:`NotSupported` (naming the strides) when one of ``tensors`` is not dense in its last
    ``dims`` dims: the peer kernels take no stride for those dims (``reads`` says how they address them,
    e.g. ``seq_lens_ptr + seq_idx``), so a view strided there would be read at the wrong elements, silently
    (none of them checks). Dims of size 1 have no stride to get wrong."""
    for what, t in tensors.items():
        expected = 1
        for size, stride in zip(reversed(t.shape[-dims:]), reversed(t.stride()[-dims:])):
            if size > 1 and stride != expected:
                raise NotSupported(
                    f"{name}: {what} with strides {t.stride()} (shape {tuple(t.shape)}): the kernel reads its "
                    f"last {dims} dim(s) as one dense run ({reads}), taking no stride for them"
                )
            expected *= size


def host_lengths(seq_lens: torch.Tensor) -> list[int]:
    return [int(n) for n in seq_lens.tolist()]
