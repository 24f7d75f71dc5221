"""Where one batch's time goes, by kind of work, from a torch.profiler op table.

Both engines are profiled the same way (:mod:`.step_profile`): every op's *self* CPU time (its own time,
not its children's) is put in one category by its name, and what the profile's ops do not cover is the
host: the batch's wall time minus the ops' self time is Python — scheduling, input preparation,
detokenizing, the engine loop. Self times add up without double counting, so the categories and the
host sum to the wall time (up to the profiler's own overhead, which the page states).

The rules are by op name and are the same for both engines; the first matching rule wins. A name no rule
matches falls in ``other ops``, which the page lists by its largest names so a new op never hides.
"""

from __future__ import annotations

import re

#: (category, pattern over the op's name), first match wins
RULES: tuple[tuple[str, re.Pattern], ...] = tuple((c, re.compile(p, re.IGNORECASE)) for c, p in (
    # an op that only records a region has no self time worth a category; the profiler's own marks
    ("profiler", r"^(ProfilerStep|\[memory\]|cudaDeviceSynchronize)"),
    # vLLM's CPU attention ops and KV-cache writes are custom ops (_C::...); ours are SDPA and the gather
    ("attention", r"(attention|attn|scaled_dot_product|sdpa|softmax|logsumexp|paged|flash)"),
    ("KV write and gather", r"(reshape_and_cache|cache|index_select|index_copy|index_put|scatter|gather)"),
    ("GEMM (linear layers, LM head)", r"(addmm|(^|::)mm$|(^|::)bmm$|linear|matmul|gemm|onednn|mkldnn|dnnl|_mm$)"),
    ("norms, rotary, activations", r"(rms_norm|layer_norm|rotary|silu|gelu|act_and_mul|"
                                   r"(^|::)(rsqrt|pow|mean|neg|cos|sin|exp|sigmoid)_?$)"),
    ("sampling", r"(argmax|topk|top_k|multinomial|log_softmax|sampl|(^|::)(sort|max|min)$)"),
    # whole op names only: a substring such as "cat" or "to" is in too many other names
    ("tensor bookkeeping", r"(^|::)(copy|to|_to_copy|empty|empty_strided|zeros|zeros_like|ones|full|fill|cat|"
                           r"stack|view|reshape|select|slice|narrow|index|transpose|permute|contiguous|clone|"
                           r"as_strided|unsqueeze|squeeze|expand|split|chunk|where|masked_fill|from_numpy|arange|"
                           r"item|_local_scalar_dense|tensor|resize|set|detach|lift_fresh|t|unbind|flatten|"
                           r"_unsafe_view|alias|new_empty|scalar_tensor|repeat_interleave)_?$"),
    ("elementwise arithmetic", r"(^|::)(add|sub|rsub|mul|div|addcmul|clamp|abs|eq|ne|lt|gt|le|ge|any|all|sum|"
                               r"cumsum|isfinite|isinf|isnan|bitwise_\w+|logical_\w+|floor|ceil|round|"
                               r"maximum|minimum)_?$"),
))
OTHER = "other ops"
HOST = "host (outside any op)"
CATEGORIES = (*dict.fromkeys(c for c, _ in RULES), OTHER, HOST)


def category(name: str) -> str:
    for cat, pattern in RULES:
        if pattern.search(name):
            return cat
    return OTHER


def by_category(ops: list[dict], wall_s: float) -> dict:
    """``ops``: ``{"name", "self_cpu_s", "calls"}`` rows of one profiled batch; ``wall_s``: its wall time.
    Returns seconds per category (host = wall - the ops' self time, never below 0), the largest names of
    ``other ops`` and the ops' total self time."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    other: dict[str, float] = {}
    for op in ops:
        cat = category(op["name"])
        seconds[cat] += op["self_cpu_s"]
        if cat == OTHER:
            other[op["name"]] = other.get(op["name"], 0.0) + op["self_cpu_s"]
    ops_s = sum(op["self_cpu_s"] for op in ops)
    seconds[HOST] = max(wall_s - ops_s, 0.0)
    top_other = sorted(other.items(), key=lambda kv: -kv[1])[:5]
    return {"seconds": seconds, "ops_s": ops_s, "wall_s": wall_s, "top_other": top_other}
