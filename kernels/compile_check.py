"""Compile every Triton kernel for a CUDA target on a machine without a GPU, and report registers,
spills and tensor-core instructions: catches code that the interpreter accepts but the compiler rejects,
tiles that spill, and a prefill that misses the tensor cores.

    python -m pagedbench.kernels.compile_check [--arch 90] [--dtypes fp16,bf16,fp32]   # every configuration
    python -m pagedbench.kernels.compile_check --fast                                  # one pinned one per kernel

The full check compiles every configuration the launchers can choose on a GPU for a few representative
shapes: the pinned decode tiles, and every prefill autotune config that ``prune_prefill_configs`` keeps.
It fails (exit status 1) when a configuration spills registers, or an fp16/bf16 prefill configuration
has no tensor-core instruction (HMMA/HGMMA) in its SASS. ``--fast`` compiles one pinned configuration
per kernel and dtype (the test suite runs it).

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


TENSOR_CORE_OPS = re.compile(r"\b(HMMA|HGMMA|WGMMA|IMMA)\b")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def _resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers, stack bytes, tensor-core instructions) of a compiled kernel; -1 when not reported."""
    text = _cuobjdump(cubin, "--dump-resource-usage")
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    tensor_ops = len(TENSOR_CORE_OPS.findall(_cuobjdump(cubin, "-sass")))
    return (int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1, tensor_ops)


class _Operand:
    """Stands in for a tensor argument of the autotune prune filter (it asks only the element size)."""

    def __init__(self, element_size: int):
        self._size = element_size

    def element_size(self) -> int:
        return self._size


def _cases(dtype: str, attn_k, cache_k, fast: bool) -> list[tuple[object, dict[str, str], dict[str, object],
                                                                      int, int]]:
    """(compiled kernel, pointer types, constexprs, num_warps, num_stages) for the launchers' GPU
    configurations (``fast``: one pinned configuration per kernel); ``attn_k`` and ``cache_k`` are the
    freshly loaded kernel modules."""
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
    element_size = 4 if dtype == "fp32" else 2
    shapes = ((4, 128),) if fast else ((1, 128), (4, 128), (8, 128), (1, 256), (4, 64))
    cases = []
    for group, head_dim in shapes:
        t = attention.decode_tiles(group, head_dim, 8192, False,
                                   attention.decode_uses_dot(group, False, element_size))
        variants = [(True, attn_ptrs, 16)] if fast else [(True, attn_ptrs, 16), (True, split_ptrs, 16),
                                                          (True, attn_ptrs, 0), (False, attn_ptrs, 0)]
        for paged, ptrs, block_size in variants:
            cases.append((attn_k._decode_partial_kernel, ptrs, {
                "PAGED": paged, "USE_DOT": t.use_dot, "BLOCK_SIZE": block_size, "BLOCK_G": t.block_g,
                "BLOCK_N": t.block_n, "BLOCK_D": t.block_d}, t.num_warps, 3))
        pinned = attention.prefill_tiles(group, head_dim, 512, False, True, element_size)
        fixed = {"USE_DOT": True, "BLOCK_SIZE": 16, "BLOCK_G": pinned.block_g, "BLOCK_D": pinned.block_d}
        if fast:
            configs = [(pinned.block_r, pinned.block_n, pinned.num_warps, 3)]
        else:
            kept = attn_k.prune_prefill_configs(attn_k.PREFILL_CONFIGS, {"q_ptr": _Operand(element_size)},
                                                **fixed)
            configs = [(c.kwargs["BLOCK_R"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
        for rows, keys, warps, stages in configs:
            cases.append((attn_k._prefill_kernel, attn_ptrs, {**fixed, "BLOCK_R": rows, "BLOCK_N": keys},
                          warps, stages))
    cases.append((attn_k._decode_reduce_kernel, reduce_ptrs, {"BLOCK_SPLITS": 16, "BLOCK_D": 128}, 4, 3))
    t, hd = cache_ops.write_kv_tiles(8, 128, interpret=False)
    cases.append((cache_k._write_kv_kernel, cache_ptrs, {"BLOCK_T": t, "BLOCK_HD": hd}, 4, 3))
    block = cache_ops.copy_blocks_tile(16 * 8 * 128, False)
    cases.append((cache_k._copy_blocks_kernel, cache_ptrs, {"BLOCK": block}, 4, 3))
    return cases


def _compile_all(argv: list[str]) -> int:
    """The child: must run before anything imports triton in interpreter mode (see the docstring)."""
    parser = argparse.ArgumentParser(prog="python -m pagedbench.kernels.compile_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    parser.add_argument("--dtypes", default="fp16,bf16,fp32")
    parser.add_argument("--fast", action="store_true", help="one pinned configuration per kernel and dtype")
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
    problems = []
    count = 0
    for dtype in args.dtypes.split(","):
        for fn, ptrs, consts, warps, stages in _cases(dtype, attn_k, cache_k, args.fast):
            src = ASTSource(fn, _signature(fn, ptrs, consts), constexprs=consts)
            compiled = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
            regs, stack, tensor_ops = _resources(compiled.asm["cubin"])
            name = f"sm_{args.arch} {dtype} {fn.fn.__name__} out={ptrs.get('out_ptr', '-')} {consts} " \
                   f"warps={warps} stages={stages}"
            print(f"{name}: registers {regs}, stack {stack} bytes, tensor-core instructions {tensor_ops}")
            count += 1
            if stack != 0:
                problems.append(f"{name}: spills ({stack} bytes of stack)")
            if fn.fn.__name__ == "_prefill_kernel" and dtype != "fp32" and tensor_ops == 0:
                problems.append(f"{name}: no tensor-core instruction")
    print(f"compiled {count} configuration(s); {len(problems)} problem(s)")
    for p in problems:
        print(f"PROBLEM {p}")
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    """Run :func:`_compile_all` in a child process with ``TRITON_INTERPRET`` unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(Path(__file__)), *argv], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(_compile_all(sys.argv[1:]) if not __package__ else main(sys.argv[1:]))
