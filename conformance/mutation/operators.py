"""Mutation operators over the project's own source: each finds its sites with ``ast`` and rewrites the
exact source span (line, column) as text, so everything else in the file, ``@triton.jit`` kernels
included, stays byte-for-byte as written (Triton re-reads a kernel's source when it compiles it).

An operator is a function ``(tree, path) -> [Site]``; :func:`mutants_of` applies every site of every
operator to a file and keeps the mutants that still parse. The operators and what they model:

=====================  =========================================================================
``int32_offset``       drop a ``.to(tl.int64)`` cast: offsets formed in 32 bits wrap past 2^31
``bound_plus_one``     ``i < n`` becomes ``i < n + 1``: one element past a length or mask bound
``bound_minus_one``    ``i < n`` becomes ``i < n - 1``: the last element is dropped
``drop_mask``          a ``tl.load``/``tl.store`` without its ``mask=`` (and ``other=``)
``swap_dot_operands``  ``tl.dot(a, b)`` becomes ``tl.dot(b, a)``
``drop_inf_guard``     ``tl.where(x == -inf, 0.0, x)`` becomes ``x`` (empty rows then give NaN)
``launch_arg_plus_one`` a size handed to a kernel launch, plus one
``grid_minus_one``     one program fewer along a grid axis
``compare_boundary``   ``<`` and ``<=`` (``>`` and ``>=``) swapped
``const_off_by_one``   ``x - 1`` / ``x + 1`` becomes ``x`` in host code
``skip_cow``           the copy-on-write test always says the block is the sequence's own
``ref_count_off_by_one`` a ``ref_count`` increment or decrement by 0 or 2 instead of 1
``preempt_oldest``     the preemption victim is ``running[0]`` instead of ``running[-1]``
``budget_not_charged`` a ``budget -= n`` that charges nothing
``sampler_arith``      temperature divides -> multiplies; top-p mass includes the token itself;
                       ``searchsorted(right=True)`` -> ``right=False``
``drop_guard``         an early exit (``if c: return``/``continue``/``break``) never taken
``eviction_order``     LRU order broken: a touched entry moved to the LRU end, the eviction scan run
                       from the MRU end, or its pin test dropped
``range_off_by_one``   a range ``[a, b)`` one element too long, or shifted one element on
``copy_direction``     a planned block copy's source and destination swapped
=====================  =========================================================================
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Site:
    """One rewrite: the source span ``[(line, col), (end_line, end_col))`` (1-based lines, 0-based
    UTF-8 byte columns, as ``ast`` gives them) becomes ``replacement``."""

    line: int
    col: int
    end_line: int
    end_col: int
    replacement: str


@dataclass(frozen=True, slots=True)
class Mutant:
    """One mutated file: which operator, where, what it changed, and the whole new source."""

    operator: str
    path: str  # relative to the repository root, e.g. "kernels/attention_kernels.py"
    line: int
    function: str  # the enclosing function ("" at module level)
    original: str  # the span before ...
    mutated: str  # ... and after
    source: str  # the complete mutated file

    @property
    def mutant_id(self) -> str:
        return f"{self.operator}@{self.path}:{self.line}:{_short(self.mutated)}"

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"


def _short(text: str) -> str:
    return " ".join(text.split())[:40]


def _segment(lines: list[bytes], line: int, col: int, end_line: int, end_col: int) -> str:
    if line == end_line:
        return lines[line - 1][col:end_col].decode()
    parts = [lines[line - 1][col:], *lines[line : end_line - 1], lines[end_line - 1][:end_col]]
    return b"".join(parts).decode()


def apply_site(source: str, site: Site) -> tuple[str, str]:
    """(mutated source, original text of the span)."""
    lines = source.encode().splitlines(keepends=True)
    original = _segment(lines, site.line, site.col, site.end_line, site.end_col)
    head = b"".join(lines[: site.line - 1]) + lines[site.line - 1][: site.col]
    tail = lines[site.end_line - 1][site.end_col :] + b"".join(lines[site.end_line :])
    return (head + site.replacement.encode() + tail).decode(), original


class _Source:
    """The text of nodes, for building replacements."""

    def __init__(self, source: str) -> None:
        self.lines = source.encode().splitlines(keepends=True)

    def text(self, node: ast.AST) -> str:
        return _segment(self.lines, node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)


def _span(node: ast.AST, replacement: str) -> Site:
    return Site(node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, replacement)


def _is_attr(node: ast.AST, owner: str, name: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.value, ast.Name)
        and node.value.id == owner
    )


def _is_tl_call(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and _is_attr(node.func, "tl", name)


def _jit_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    def jitted(f: ast.FunctionDef) -> bool:
        return any(_is_attr(d, "triton", "jit") for d in f.decorator_list)

    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and jitted(n)]


def _host_nodes(tree: ast.Module):
    """Every node outside ``@triton.jit`` functions."""
    jit = set(map(id, _jit_functions(tree)))
    stack = [n for n in tree.body if id(n) not in jit]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _kernel_nodes(tree: ast.Module):
    for f in _jit_functions(tree):
        yield from ast.walk(f)


# --- kernel operators -----------------------------------------------------------------------------------
def int32_offset(tree: ast.Module, src: _Source) -> list[Site]:
    sites = []
    for n in _kernel_nodes(tree):
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "to"
            and len(n.args) == 1
            and _is_attr(n.args[0], "tl", "int64")
        ):
            sites.append(_span(n, src.text(n.func.value)))
    return sites


def _bounds(nodes) -> list[ast.Compare]:
    """``name < bound`` comparisons (one ``<``, a name or subscript on the left)."""
    return [
        n
        for n in nodes
        if isinstance(n, ast.Compare)
        and len(n.ops) == 1
        and isinstance(n.ops[0], ast.Lt)
        and isinstance(n.left, (ast.Name, ast.Subscript, ast.BinOp))
    ]


def bound_plus_one(tree: ast.Module, src: _Source) -> list[Site]:
    return [_span(c.comparators[0], f"({src.text(c.comparators[0])}) + 1") for c in _bounds(_kernel_nodes(tree))]


def bound_minus_one(tree: ast.Module, src: _Source) -> list[Site]:
    return [_span(c.comparators[0], f"({src.text(c.comparators[0])}) - 1") for c in _bounds(_kernel_nodes(tree))]


def drop_mask(tree: ast.Module, src: _Source) -> list[Site]:
    sites = []
    for n in _kernel_nodes(tree):
        if (_is_tl_call(n, "load") or _is_tl_call(n, "store")) and any(k.arg == "mask" for k in n.keywords):
            args = [src.text(a) for a in n.args]
            args += [f"{k.arg}={src.text(k.value)}" for k in n.keywords if k.arg not in ("mask", "other")]
            sites.append(_span(n, f"{src.text(n.func)}({', '.join(args)})"))
    return sites


def swap_dot_operands(tree: ast.Module, src: _Source) -> list[Site]:
    sites = []
    for n in _kernel_nodes(tree):
        if _is_tl_call(n, "dot") and len(n.args) >= 2:
            a, b = n.args[0], n.args[1]
            sites.append(Site(a.lineno, a.col_offset, b.end_lineno, b.end_col_offset, f"{src.text(b)}, {src.text(a)}"))
    return sites


def drop_inf_guard(tree: ast.Module, src: _Source) -> list[Site]:
    """``tl.where(x == float("-inf"), 0.0, x)`` -> ``x``."""
    sites = []
    for n in _kernel_nodes(tree):
        if _is_tl_call(n, "where") and len(n.args) == 3 and isinstance(n.args[0], ast.Compare):
            test = n.args[0]
            if isinstance(test.ops[0], ast.Eq) and "-inf" in src.text(test.comparators[0]):
                sites.append(_span(n, src.text(n.args[2])))
    return sites


# --- launcher operators ---------------------------------------------------------------------------------
_SIZE_WORDS = ("num_", "head_dim", "block_size", "group", "shape.", "shape[", "window")


def _launches(tree: ast.Module) -> list[ast.Call]:
    """``kernel[grid](...)`` calls."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)]


def launch_arg_plus_one(tree: ast.Module, src: _Source) -> list[Site]:
    sites = []
    for call in _launches(tree):
        for a in call.args:
            text = src.text(a)
            if not isinstance(a, ast.Starred) and any(w in text for w in _SIZE_WORDS) and "stride" not in text:
                sites.append(_span(a, f"({text}) + 1"))
    return sites


def stride_assumed_dense(tree: ast.Module, src: _Source) -> list[Site]:
    """A launch's ``*t.stride()`` -> ``*t.contiguous().stride()``: the strides a dense copy of ``t`` would
    have, while the kernel still reads ``t`` itself, as a launcher that assumes its tensors contiguous
    passes (right for every dense tensor, wrong for a strided view)."""
    sites = []
    for call in _launches(tree):
        for a in call.args:
            v = a.value if isinstance(a, ast.Starred) else None
            if (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "stride"
                    and not v.args):
                sites.append(_span(v, f"{src.text(v.func.value)}.contiguous().stride()"))
    return sites


def grid_minus_one(tree: ast.Module, src: _Source) -> list[Site]:
    """One program fewer along each axis of a grid tuple (a literal one, or one a ``grid`` function returns)."""
    tuples = []
    for call in _launches(tree):
        g = call.func.slice
        if isinstance(g, ast.Tuple):
            tuples.append(g)
    for f in ast.walk(tree):
        if isinstance(f, ast.FunctionDef) and f.name == "grid":
            tuples += [r.value for r in ast.walk(f) if isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple)]
    for n in ast.walk(tree):
        named_grid = isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "grid" for t in n.targets)
        if named_grid and isinstance(n.value, ast.Tuple):
            tuples.append(n.value)
    return [_span(e, f"max(({src.text(e)}) - 1, 1)") for t in tuples for e in t.elts]


# --- host operators -------------------------------------------------------------------------------------
_SWAP = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}


def _checked_nodes(tree: ast.Module):
    """Kernel files: the kernels' nodes, less ``tl.static_assert`` (compile-time sanity checks); host
    files: every node."""
    jit = _jit_functions(tree)
    if not jit:
        yield from ast.walk(tree)
        return
    asserts = {id(x) for n in _kernel_nodes(tree) if _is_tl_call(n, "static_assert") for x in ast.walk(n)}
    yield from (n for n in _kernel_nodes(tree) if id(n) not in asserts)


def compare_boundary(tree: ast.Module, src: _Source) -> list[Site]:
    """``<``/``<=`` and ``>``/``>=`` swapped (in kernels, all but the ``<`` bounds the bound operators take)."""
    sites = []
    kernel_lt = {id(c) for c in _bounds(_kernel_nodes(tree))}
    for n in _checked_nodes(tree):
        if id(n) in kernel_lt:
            continue
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in _SWAP:
            left, right = src.text(n.left), src.text(n.comparators[0])
            sites.append(_span(n, f"{left} {_SWAP[type(n.ops[0])]} {right}"))
    return sites


def const_off_by_one(tree: ast.Module, src: _Source) -> list[Site]:
    sites = []
    for n in _host_nodes(tree):
        if (
            isinstance(n, ast.BinOp)
            and isinstance(n.op, (ast.Add, ast.Sub))
            and isinstance(n.right, ast.Constant)
            and n.right.value == 1
        ):
            sites.append(_span(n, src.text(n.left)))
    return sites


def skip_cow(tree: ast.Module, src: _Source) -> list[Site]:
    """The copy-on-write hook's ``ref_count == 1`` test (and ``can_append``'s ``ref_count > 1``,
    ``append_token``'s ``ref_count != 1``) made constant: a shared block is written in place."""
    sites = []
    for n in _host_nodes(tree):
        if isinstance(n, ast.Compare) and isinstance(n.left, ast.Attribute) and n.left.attr == "ref_count":
            rhs = n.comparators[0]
            if isinstance(rhs, ast.Constant) and rhs.value == 1:
                if isinstance(n.ops[0], ast.Eq):
                    sites.append(_span(n, "True"))
                elif isinstance(n.ops[0], (ast.Gt, ast.NotEq)):
                    sites.append(_span(n, "False"))
    return sites


def ref_count_off_by_one(tree: ast.Module, src: _Source) -> list[Site]:
    sites = []
    for n in _host_nodes(tree):
        if (
            isinstance(n, ast.AugAssign)
            and isinstance(n.target, ast.Attribute)
            and n.target.attr == "ref_count"
            and isinstance(n.value, ast.Constant)
            and n.value.value == 1
        ):
            sites.append(_span(n.value, "0"))
            sites.append(_span(n.value, "2"))
    return sites


def preempt_oldest(tree: ast.Module, src: _Source) -> list[Site]:
    sites = []
    for n in _host_nodes(tree):
        if isinstance(n, ast.Subscript) and src.text(n.value) in ("self.running", "running") \
                and src.text(n.slice) == "-1":
            sites.append(_span(n.slice, "0"))
    return sites


def budget_not_charged(tree: ast.Module, src: _Source) -> list[Site]:
    return [
        _span(n.value, "0")
        for n in _host_nodes(tree)
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == "budget"
    ]


def sampler_arith(tree: ast.Module, src: _Source) -> list[Site]:
    sites = []
    for n in _host_nodes(tree):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and "temperature" in src.text(n.right):
            sites.append(_span(n, f"{src.text(n.left)} * {src.text(n.right)}"))
        if (
            isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Sub)
            and src.text(n.left) == "cum"
            and src.text(n.right) == "sorted_probs"
        ):
            sites.append(_span(n, "cum"))
        if isinstance(n, ast.keyword) and n.arg == "right" and isinstance(n.value, ast.Constant):
            sites.append(_span(n.value, repr(not n.value.value)))
    return sites


def drop_guard(tree: ast.Module, src: _Source) -> list[Site]:
    """``if c: return`` (``continue``, ``break``) with no ``else`` -> ``if False and (c):``: the case the guard
    leaves out (a block not to store, a group not to swap in yet) goes on as any other."""
    return [
        _span(n.test, f"False and ({src.text(n.test)})")  # (the test kept: each mutated line stays its own)
        for n in _host_nodes(tree)
        if isinstance(n, ast.If) and not n.orelse and len(n.body) == 1
        and isinstance(n.body[0], (ast.Return, ast.Continue, ast.Break))
    ]


def _is_items_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "items"


def eviction_order(tree: ast.Module, src: _Source) -> list[Site]:
    """An LRU map's order broken: ``m.move_to_end(k)`` -> ``m.move_to_end(k, last=False)`` (a touched
    entry becomes the next victim); an eviction scan (a ``for`` over ``m.items()`` that returns) run from
    the MRU end; the scan's pin test (an ``if`` naming ``pinned``) always true (a pinned entry evicted)."""
    sites = []
    for n in _host_nodes(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "move_to_end"
                and len(n.args) == 1 and not n.keywords):
            sites.append(_span(n, f"{src.text(n.func)}({src.text(n.args[0])}, last=False)"))
        if isinstance(n, ast.For) and _is_items_call(n.iter) and any(isinstance(x, ast.Return) for x in ast.walk(n)):
            sites.append(_span(n.iter, f"reversed(list({src.text(n.iter)}))"))
            tests = [x.test for x in ast.walk(n) if isinstance(x, ast.If)]
            sites += [_span(t, f"True or ({src.text(t)})") for t in tests if "pinned" in src.text(t)]
    return sites


def range_off_by_one(tree: ast.Module, src: _Source) -> list[Site]:
    """A half-open range with both bounds (``slice(a, b)``, ``x[a:b]``: a rank's heads, a fused part's
    rows, a block's tokens) one element too long (``b`` -> ``b + 1``) or one element further on
    (``a + 1``, ``b + 1``)."""
    sites = []
    for n in _host_nodes(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "slice" and len(n.args) == 2:
            lo, hi = n.args
        elif isinstance(n, ast.Slice) and n.lower is not None and n.upper is not None and n.step is None:
            lo, hi = n.lower, n.upper
        else:
            continue
        between = _segment(src.lines, lo.end_lineno, lo.end_col_offset, hi.lineno, hi.col_offset)
        sites.append(_span(hi, f"({src.text(hi)}) + 1"))
        sites.append(Site(lo.lineno, lo.col_offset, hi.end_lineno, hi.end_col_offset,
                          f"({src.text(lo)}) + 1{between}({src.text(hi)}) + 1"))
    return sites


def copy_direction(tree: ast.Module, src: _Source) -> list[Site]:
    """A planned copy's two block ids swapped: ``BlockSwap(a, b)`` / ``BlockCopy(a, b)``, and a
    ``(a, b)`` pair appended to a list of stores or loads, become ``(b, a)`` (the copy overwrites the
    block it should read)."""
    sites = []
    for n in _host_nodes(tree):
        if not isinstance(n, ast.Call):
            continue
        pair = None
        if isinstance(n.func, ast.Name) and n.func.id in ("BlockSwap", "BlockCopy") and len(n.args) == 2:
            pair = n.args
        elif (isinstance(n.func, ast.Attribute) and n.func.attr == "append" and len(n.args) == 1
              and isinstance(n.args[0], ast.Tuple) and len(n.args[0].elts) == 2
              and any(w in src.text(n.func.value) for w in ("store", "load"))):
            pair = n.args[0].elts
        if pair is not None:
            a, b = pair
            sites.append(Site(a.lineno, a.col_offset, b.end_lineno, b.end_col_offset, f"{src.text(b)}, {src.text(a)}"))
    return sites


Operator = Callable[[ast.Module, _Source], list[Site]]
KERNEL_OPERATORS: dict[str, Operator] = {
    "int32_offset": int32_offset,
    "bound_plus_one": bound_plus_one,
    "bound_minus_one": bound_minus_one,
    "drop_mask": drop_mask,
    "swap_dot_operands": swap_dot_operands,
    "drop_inf_guard": drop_inf_guard,
}
LAUNCHER_OPERATORS: dict[str, Operator] = {"launch_arg_plus_one": launch_arg_plus_one, "grid_minus_one": grid_minus_one,
                                           "stride_assumed_dense": stride_assumed_dense}
HOST_OPERATORS: dict[str, Operator] = {
    "compare_boundary": compare_boundary,
    "const_off_by_one": const_off_by_one,
    "skip_cow": skip_cow,
    "ref_count_off_by_one": ref_count_off_by_one,
    "preempt_oldest": preempt_oldest,
    "budget_not_charged": budget_not_charged,
    "sampler_arith": sampler_arith,
    "drop_guard": drop_guard,
    "eviction_order": eviction_order,
    "range_off_by_one": range_off_by_one,
    "copy_direction": copy_direction,
}
OPERATORS: dict[str, Operator] = {**KERNEL_OPERATORS, **LAUNCHER_OPERATORS, **HOST_OPERATORS}


def _enclosing_function(tree: ast.Module, line: int) -> str:
    best = ""
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno <= line <= n.end_lineno:
            best = n.name  # ast.walk is breadth-first: the innermost match comes last
    return best


def mutants_of(path: str, source: str, operators: dict[str, Operator]) -> list[Mutant]:
    """Every mutant the operators make of one file (``path`` as recorded), in source order per
    operator; a rewrite that no longer parses is dropped (none of ours should: the tests check)."""
    tree = ast.parse(source)
    src = _Source(source)
    found = []
    for name, operator in operators.items():
        for site in sorted(operator(tree, src), key=lambda s: (s.line, s.col)):
            mutated, original = apply_site(source, site)
            try:
                ast.parse(mutated)
            except SyntaxError:
                continue
            found.append(
                Mutant(name, path, site.line, _enclosing_function(tree, site.line), original, site.replacement, mutated)
            )
    return found


def read_mutants(root: Path, path: str, operators: dict[str, Operator]) -> list[Mutant]:
    return mutants_of(path, (root / path).read_text(encoding="utf-8"), operators)
