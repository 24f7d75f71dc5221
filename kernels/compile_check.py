"""Compile every Triton kernel for a CUDA target on a machine without a GPU, and report registers,
spills and tensor-core instructions: catches code that the interpreter accepts but the compiler rejects,
tiles that spill, and a prefill that misses the tensor cores.

    python -m pagedbench.kernels.compile_check [--arch 90] [--dtypes fp16,bf16,fp32]   # every configuration
    python -m pagedbench.kernels.compile_check --fast                                  # one pinned one per kernel
    python -m pagedbench.bench.compile_check --out results       # published: results/compile_check.{json,md}

The full check compiles every configuration the launchers can choose on a GPU for a few representative
shapes: the pinned decode tiles, and every prefill autotune config that ``prune_prefill_configs`` keeps,
each specialised as a launch on contiguous tensors would be (see :func:`_specialise`).
It fails (exit status 1) when a configuration spills registers, an fp16/bf16 prefill configuration
has no tensor-core instruction (HMMA/HGMMA) in its SASS, or a kernel meant to multiply by broadcast and
sum has a ``tt.dot`` in its IR (Triton's combiner makes one of a product whose sides are all >= 16, in
TF32 on some versions: float32 decode at GQA group 16 was off by 4e-4 on an H200 with Triton 3.6).
``--fast`` compiles one pinned configuration per kernel and dtype (the test suite runs it).

Triton's wheel carries ``ptxas`` and ``cuobjdump``, so no driver is needed. Triton decides at import
whether it interprets, and importing ``kernels`` turns the interpreter on where there is no GPU, so the
work runs in a child process that loads the kernel modules (and so Triton) before ``kernels`` itself.
The configurations are those the launchers choose on a GPU for a few representative shapes.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
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


def _strides(prefix: str, names: str, shape: tuple[int, ...]) -> dict[str, int]:
    """``stride_<prefix>_<n>`` of a contiguous tensor of ``shape``, one name letter per dimension."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return {f"stride_{prefix}_{n}": st for n, st in zip(names.split(","), reversed(strides))}


def _launch_values(kernel: str, group: int, head_dim: int, *, paged: bool = True, split: bool = False,
                   block_size: int = 16) -> dict[str, int]:
    """Representative runtime integers of a launch of ``kernel`` on contiguous tensors, as the launchers
    pass them (8 sequences of 64 blocks, 512 query tokens, 8 KV heads, 16 splits), by argument name."""
    kvh, splits, seqs, tokens = 8, 16, 8, 512
    h = kvh * group
    cache = (1024, block_size, kvh, head_dim)
    common = {"sliding_window": 0, "block_size": block_size, "group_size": group, "head_dim": head_dim}
    if kernel == "_decode_partial_kernel":
        kv = cache if paged else (seqs, 8192, kvh, head_dim)
        out = (_strides("out", "s,h,split,d", (seqs, h, splits, head_dim)) if split else
               {**_strides("out", "s,h,d", (seqs, h, head_dim)), "stride_out_split": 0})
        lse = (_strides("lse", "s,h,split", (seqs, h, splits)) if split else
               {**_strides("lse", "s,h", (seqs, h)), "stride_lse_split": 0})
        table = _strides("bt", "s,b", (seqs, 64)) if paged else {"stride_bt_s": 0, "stride_bt_b": 0}
        return {**common, "num_splits": splits if split else 1, **_strides("q", "s,h,d", (seqs, h, head_dim)),
                **_strides("k", "b,o,h,d", kv), **_strides("v", "b,o,h,d", kv), **table, **out, **lse}
    if kernel == "_prefill_kernel":
        return {**common, **_strides("q", "t,h,d", (tokens, h, head_dim)), **_strides("k", "b,o,h,d", cache),
                **_strides("v", "b,o,h,d", cache), **_strides("bt", "s,b", (seqs, 64)),
                **_strides("out", "t,h,d", (tokens, h, head_dim)), **_strides("lse", "t,h", (tokens, h))}
    if kernel == "_decode_reduce_kernel":
        return {"num_splits": splits, "head_dim": head_dim,
                **_strides("po", "s,h,split,d", (seqs, h, splits, head_dim)),
                **_strides("pl", "s,h,split", (seqs, h, splits)),
                **_strides("out", "s,h,d", (seqs, h, head_dim)), **_strides("lse", "s,h", (seqs, h))}
    caches = {**_strides("kc", "b,o,h,d", cache), **_strides("vc", "b,o,h,d", cache),
              "block_size": block_size, "num_kv_heads": kvh, "head_dim": head_dim}
    if kernel == "_write_kv_kernel":
        return {**caches, "num_tokens": tokens, **_strides("k", "t,h,d", (tokens, kvh, head_dim)),
                **_strides("v", "t,h,d", (tokens, kvh, head_dim)), **_strides("slot", "t", (tokens,))}
    if kernel == "_copy_blocks_kernel":
        return {**caches, **_strides("pairs", "n,c", (64, 2))}
    if kernel == "_merge_attn_states_kernel":
        h = kvh * group
        parts = {**_strides("oa", "t,h,d", (tokens, h, head_dim)), **_strides("ob", "t,h,d", (tokens, h, head_dim)),
                 **_strides("o", "t,h,d", (tokens, h, head_dim))}
        lses = {**_strides("la", "t,h", (tokens, h)), **_strides("lb", "t,h", (tokens, h)),
                **_strides("l", "t,h", (tokens, h))}
        return {"num_rows": tokens * h, "num_heads": h, "head_dim": head_dim, **parts, **lses}
    raise ValueError(f"no representative launch for {kernel}")


def _specialise(fn, pointers: dict[str, str], constexprs: dict[str, object], values: dict[str, int]):
    """(signature, constexprs, attrs) as a launch with ``values`` compiles them.

    Triton's JIT turns an integer equal to 1 into a constant and marks integers divisible by 16 and
    16-byte-aligned pointers (every torch allocation); a unit innermost stride is what lets it vectorise
    loads, and compiling without these reports register spills that a real launch does not have.
    """
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    sig, consts, attrs = {}, dict(constexprs), {}
    params = inspect.signature(fn.fn).parameters
    for name, param in params.items():  # a constexpr left out takes its default (KV_FP8=False ...)
        if name not in constexprs and name not in values and param.default is not inspect.Parameter.empty:
            consts[name] = param.default
    for i, arg in enumerate(params):
        if arg in consts:
            sig[arg], spec = "constexpr", ""
        elif arg in pointers:
            sig[arg], spec = pointers[arg], "D"
        elif arg.endswith("scale"):
            sig[arg], spec = "fp32", ""  # floats are never specialised
        else:
            kind, spec = native_specialize_impl(BaseBackend, values[arg], False, True, True)
            if kind == "constexpr":
                sig[arg], consts[arg], spec = "constexpr", spec, ""
            else:
                sig[arg] = "i64" if arg.startswith("stride") else kind
        if spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


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


def _cases(dtype: str, attn_k, cache_k, fast: bool, merge_k=None) -> list[tuple]:
    """(compiled kernel, pointer types, constexprs, num_warps, num_stages, runtime integers) for the launchers' GPU
    configurations (``fast``: one pinned configuration per kernel); ``attn_k`` and ``cache_k`` are the
    freshly loaded kernel modules (``merge_k`` too, when given)."""
    from pagedbench.kernels import attention, cache_ops, merge  # the tile choices
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
    shapes = ((4, 128),) if fast else ((1, 128), (4, 128), (8, 128), (16, 128), (1, 256), (4, 64))
    cases = []
    for group, head_dim in shapes:
        t = attention.decode_tiles(group, head_dim, 8192, False,
                                   attention.decode_uses_dot(group, False, element_size))
        variants = [(True, attn_ptrs, 16)] if fast else [(True, attn_ptrs, 16), (True, split_ptrs, 16),
                                                          (True, attn_ptrs, 0), (False, attn_ptrs, 0)]
        for paged, ptrs, block_size in variants:
            # BLOCK_SIZE 0 is the generic path, taken for a block size that is not a power of two
            values = _launch_values("_decode_partial_kernel", group, head_dim, paged=paged,
                                    split=ptrs is split_ptrs, block_size=block_size or 24)
            cases.append((attn_k._decode_partial_kernel, ptrs, {
                "PAGED": paged, "USE_DOT": t.use_dot, "BLOCK_SIZE": block_size, "BLOCK_G": t.block_g,
                "BLOCK_N": t.block_n, "BLOCK_D": t.block_d},
                t.num_warps, t.num_stages or 3, values))
        pinned = attention.prefill_tiles(group, head_dim, 512, False, True, element_size)
        fixed = {"USE_DOT": True, "BLOCK_SIZE": 16, "BLOCK_G": pinned.block_g, "BLOCK_D": pinned.block_d}
        if fast:
            configs = [(pinned.block_r, pinned.block_n, pinned.num_warps, 2)]  # the stages of PREFILL_CONFIGS
        else:
            kept = attn_k.prune_prefill_configs(attn_k.PREFILL_CONFIGS, {"q_ptr": _Operand(element_size)},
                                                **fixed)
            configs = [(c.kwargs["BLOCK_R"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
        for rows, keys, warps, stages in configs:
            cases.append((attn_k._prefill_kernel, attn_ptrs, {**fixed, "BLOCK_R": rows, "BLOCK_N": keys},
                          warps, stages, _launch_values("_prefill_kernel", group, head_dim)))
    if fast and dtype == "fp32":  # the broadcast path at a group whose sides all reach 16 (the combiner's dot)
        t = attention.decode_tiles(16, 32, 8192, False, False)
        cases.append((attn_k._decode_partial_kernel, attn_ptrs, {
            "PAGED": True, "USE_DOT": False, "BLOCK_SIZE": 16, "BLOCK_G": t.block_g, "BLOCK_N": t.block_n,
            "BLOCK_D": t.block_d}, t.num_warps, 3, _launch_values("_decode_partial_kernel", 16, 32)))
    cases.append((attn_k._decode_reduce_kernel, reduce_ptrs, {"BLOCK_SPLITS": 16, "BLOCK_D": 128}, 4, 3,
                  _launch_values("_decode_reduce_kernel", 4, 128)))
    t, hd = cache_ops.write_kv_tiles(8, 128, interpret=False)
    cases.append((cache_k._write_kv_kernel, cache_ptrs, {"BLOCK_T": t, "BLOCK_HD": hd}, 4, 3,
                  _launch_values("_write_kv_kernel", 4, 128)))
    block = cache_ops.copy_blocks_tile(16 * 8 * 128, False)
    cases.append((cache_k._copy_blocks_kernel, cache_ptrs, {"BLOCK": block}, 4, 3,
                  _launch_values("_copy_blocks_kernel", 4, 128)))
    # fp8 KV caches: read by decode and prefill, written (quantized) by write_kv (fast: beside fp16 only)
    if dtype == "fp16" or (dtype == "bf16" and not fast):
        fp8_ptrs = {**attn_ptrs, "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}
        t = attention.decode_tiles(4, 128, 8192, False, attention.decode_uses_dot(4, False, element_size))
        cases.append((attn_k._decode_partial_kernel, fp8_ptrs, {
            "PAGED": True, "USE_DOT": t.use_dot, "BLOCK_SIZE": 16, "BLOCK_G": t.block_g, "BLOCK_N": t.block_n,
            "BLOCK_D": t.block_d, "KV_FP8": True}, t.num_warps,
            t.num_stages or 3, _launch_values("_decode_partial_kernel", 4, 128)))
        pinned = attention.prefill_tiles(4, 128, 512, False, True, element_size)
        cases.append((attn_k._prefill_kernel, fp8_ptrs, {
            "USE_DOT": True, "BLOCK_SIZE": 16, "BLOCK_G": pinned.block_g, "BLOCK_D": pinned.block_d,
            "BLOCK_R": pinned.block_r, "BLOCK_N": pinned.block_n, "KV_FP8": True}, pinned.num_warps, 2,
            _launch_values("_prefill_kernel", 4, 128)))
        t, hd = cache_ops.write_kv_tiles(8, 128, interpret=False)
        quant_ptrs = {**cache_ptrs, "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "k_cache_ptr": "*fp8e4nv",
                      "v_cache_ptr": "*fp8e4nv"}
        cases.append((cache_k._write_kv_kernel, quant_ptrs, {"BLOCK_T": t, "BLOCK_HD": hd, "QUANTIZE": True}, 4, 3,
                      _launch_values("_write_kv_kernel", 4, 128)))
    if merge_k is not None:
        merge_ptrs = {"out_a_ptr": f"*{dtype}", "lse_a_ptr": "*fp32", "out_b_ptr": f"*{dtype}", "lse_b_ptr": "*fp32",
                      "out_ptr": f"*{dtype}", "lse_ptr": "*fp32"}
        rows, dims = merge.merge_tiles(128, interpret=False)
        cases.append((merge_k._merge_attn_states_kernel, merge_ptrs, {"BLOCK_R": rows, "BLOCK_D": dims}, 4, 3,
                      _launch_values("_merge_attn_states_kernel", 4, 128)))
    return cases


def _compile_all(argv: list[str]) -> int:
    """The child: must run before anything imports triton in interpreter mode (see the docstring)."""
    parser = argparse.ArgumentParser(prog="python -m pagedbench.kernels.compile_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    parser.add_argument("--dtypes", default="fp16,bf16,fp32")
    parser.add_argument("--fast", action="store_true", help="one pinned configuration per kernel and dtype")
    parser.add_argument("--rows", help="also write the configurations as a JSON list into this file (the input of "
                                       "`python -m pagedbench.bench.compile_check`, which publishes them)")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    attn_k, cache_k = _load_compiled("attention_kernels"), _load_compiled("cache_kernels")
    merge_k = _load_compiled("merge_kernels")
    sys.path.insert(0, str(HERE.parent))
    from pagedbench import kernels  # noqa: F401  (for the tile choices; it may switch the interpreter knob on again)

    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    problems, rows = [], []
    count = 0
    for dtype in args.dtypes.split(","):
        for fn, ptrs, consts, warps, stages, values in _cases(dtype, attn_k, cache_k, args.fast, merge_k):
            sig, all_consts, attrs = _specialise(fn, ptrs, consts, values)
            src = ASTSource(fn, sig, constexprs=all_consts, attrs=attrs)
            compiled = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
            regs, stack, tensor_ops = _resources(compiled.asm["cubin"])
            name = f"sm_{args.arch} {dtype} {fn.fn.__name__} out={ptrs.get('out_ptr', '-')} {consts} " \
                   f"warps={warps} stages={stages}"
            print(f"{name}: registers {regs}, stack {stack} bytes, tensor-core instructions {tensor_ops}")
            count += 1
            found = []
            if stack != 0:
                found.append(f"spills ({stack} bytes of stack)")
            if fn.fn.__name__ == "_prefill_kernel" and dtype != "fp32" and tensor_ops == 0:
                found.append("no tensor-core instruction")
            if not consts.get("USE_DOT", True) and "tt.dot" in compiled.asm["ttir"]:
                # the combiner turned a broadcast product into a dot, whose precision is the Triton version's
                found.append("a broadcast product compiled into tt.dot (TF32 on some Triton versions)")
            problems += [f"{name}: {f}" for f in found]
            rows.append({"dtype": dtype, "kernel": fn.fn.__name__, "out": ptrs.get("out_ptr", "-"),
                         "constexprs": {k: v for k, v in consts.items()}, "num_warps": warps,
                         "num_stages": stages, "registers": regs, "stack_bytes": stack,
                         "tensor_core_instructions": tensor_ops, "problems": found})
    print(f"compiled {count} configuration(s); {len(problems)} problem(s)")
    for p in problems:
        print(f"PROBLEM {p}")
    if args.rows:
        Path(args.rows).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    """Run :func:`_compile_all` in a child process with ``TRITON_INTERPRET`` unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(Path(__file__)), *argv], env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(_compile_all(sys.argv[1:]) if not __package__ else main(sys.argv[1:]))
