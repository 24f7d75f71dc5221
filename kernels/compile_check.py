"""Compile every Triton kernel for a CUDA target on a machine without a GPU, and report registers and
spills: catches code that the interpreter accepts but the compiler rejects, and tiles that spill.

    python -m pagedbench.kernels.compile_check [--arch 90] [--dtypes fp16,bf16,fp32]

Triton's wheel carries ``ptxas`` and ``cuobjdump``, so no driver is needed. Triton decides at import
whether it interprets, and importing ``kernels`` turns the interpreter on where there is no GPU, so the
work runs in a child process that loads the kernel modules (and so Triton) before ``kernels`` itself.
The configurations are those the launchers choose on a GPU for a few representative shapes.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load_compiled(name: str):
    """``kernels/<name>.py`` as a new module whose ``@triton.jit`` functions compile (not interpreted)."""
    spec = importlib.util.spec_from_file_location(f"_compile_check_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _signature(fn, pointers: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for arg in inspect.signature(fn.fn).parameters:
        if arg in constexprs:
            sig[arg] = "constexpr"
        elif arg in pointers:
            sig[arg] = pointers[arg]
        else:
            sig[arg] = "fp32" if arg == "scale" else ("i64" if arg.startswith("stride") else "i32")
    return sig


def _resources(cubin: bytes) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return f"registers {regs.group(1) if regs else '?'}, stack {stack.group(1) if stack else '?'} bytes"


def _cases(dtype: str, attn_k, cache_k) -> list[tuple[object, dict[str, str], dict[str, object], int]]:
    """(compiled kernel, pointer types, constexprs, num_warps) for the launchers' GPU configurations;
    ``attn_k`` and ``cache_k`` are the freshly loaded kernel modules."""
    from pagedbench.kernels import attention, cache_ops  # the tile choices
    attn_ptrs = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
                 "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
                 "out_ptr": f"*{dtype}", "lse_ptr": "*fp32"}
    split_ptrs = {**attn_ptrs, "out_ptr": "*fp32"}
    reduce_ptrs = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{dtype}",
                   "lse_ptr": "*fp32"}
    bits = {"fp16": "*i16", "bf16": "*i16", "fp32": "*i32"}[dtype]
    cache_ptrs = {"k_ptr": bits, "v_ptr": bits, "k_cache_ptr": bits, "v_cache_ptr": bits, "slot_ptr": "*i64",
                  "pairs_ptr": "*i64"}
    cases = []
    for group, head_dim in ((1, 128), (4, 128), (8, 128), (1, 256), (4, 64)):
        t = attention.decode_tiles(group, head_dim, 8192, interpret=False)
        for paged, ptrs in ((True, attn_ptrs), (True, split_ptrs), (False, attn_ptrs)):
            cases.append((attn_k._decode_partial_kernel, ptrs, {"PAGED": paged, "BLOCK_G": t.block_g,
                          "BLOCK_N": t.block_n, "BLOCK_D": t.block_d}, t.num_warps))
        p = attention.prefill_tiles(group, head_dim, 512, interpret=False)
        cases.append((attn_k._prefill_kernel, attn_ptrs, {"USE_DOT": True, "BLOCK_M": p.block_m,
                      "BLOCK_G": p.block_g, "BLOCK_N": p.block_n, "BLOCK_D": p.block_d}, p.num_warps))
    cases.append((attn_k._decode_reduce_kernel, reduce_ptrs, {"BLOCK_SPLITS": 16, "BLOCK_D": 128}, 4))
    t, hd = cache_ops.write_kv_tiles(8, 128, interpret=False)
    cases.append((cache_k._write_kv_kernel, cache_ptrs, {"BLOCK_T": t, "BLOCK_HD": hd}, 4))
    block = cache_ops.copy_blocks_tile(16 * 8 * 128, False)
    cases.append((cache_k._copy_blocks_kernel, cache_ptrs, {"BLOCK": block}, 4))
    return cases


def _compile_all(argv: list[str]) -> int:
    """The child: must run before anything imports triton in interpreter mode (see the docstring)."""
    parser = argparse.ArgumentParser(prog="python -m pagedbench.kernels.compile_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    parser.add_argument("--dtypes", default="fp16,bf16,fp32")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    attn_k, cache_k = _load_compiled("attention_kernels"), _load_compiled("cache_kernels")
    sys.path.insert(0, str(HERE.parent))
    from pagedbench import kernels  # noqa: F401  (for the tile choices; it may switch the interpreter knob on again)

    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    spilled = 0
    for dtype in args.dtypes.split(","):
        for fn, ptrs, consts, warps in _cases(dtype, attn_k, cache_k):
            src = ASTSource(fn, _signature(fn, ptrs, consts), constexprs=consts)
            compiled = triton.compile(src, target=target, options={"num_warps": warps})
            usage = _resources(compiled.asm["cubin"])
            spilled += not usage.endswith("stack 0 bytes")
            out = ptrs.get("out_ptr", "-")
            print(f"sm_{args.arch} {dtype} {fn.fn.__name__} out={out} {consts} warps={warps}: {usage}")
    print(f"compiled every kernel; {spilled} configuration(s) use stack (register spills)")
    return 0


def main(argv: list[str]) -> int:
    """Run :func:`_compile_all` in a child process with ``TRITON_INTERPRET`` unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(Path(__file__)), *argv], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(_compile_all(sys.argv[1:]) if not __package__ else main(sys.argv[1:]))
