"""Every path the decode launcher's rules choose is reached and checked against the float64 oracle.

A kernel can be wrong only for the batch sizes a rule sends to it. The decode launcher picks, per call,
tl.dot or broadcast products (``decode_uses_dot``: fp16/bf16 and a GQA group of ``MIN_DOT_GROUP`` or
more, on a GPU) and split-K or one program per (sequence, KV head) (``choose_num_splits``: split while
the programs leave the device's SMs idle and the context has ``MIN_KEYS_PER_SPLIT`` keys a split).
Under the interpreter both rules answer as on one SM, so here they are made to answer as on a GPU with
``NUM_SMS`` SMs: the GPU's dot rule, and the heuristic with ``NUM_SMS``. The batch sizes sit at N-1/N/N+1
around where the split rule switches; each call's plan is recorded, the set of plans must cover every
(dot, split) combination, and every output must match the oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
from pagedbench import kernels
from pagedbench.conformance.gate import oracle
from pagedbench.conformance.gate.cases import TOLERANCES
from pagedbench.kernels import attention

NUM_SMS = 2
BS, D, WIDTH = 16, 16, 33  # tables of 33 blocks: 528 keys, just past one split's MIN_KEYS_PER_SPLIT
SWITCH = 2 * NUM_SMS  # (sequences x KV heads) programs from which the heuristic stops splitting
LAYOUTS = {"group2": (2, 1), "group4": (4, 1)}  # (num_heads, num_kv_heads); KV heads 1: programs = seqs
DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
CASES = [(n, layout, dt) for n in (1, SWITCH - 1, SWITCH, SWITCH + 1) for layout in LAYOUTS for dt in DTYPES]


@pytest.fixture
def plans(monkeypatch):
    """The launcher's rules as on a GPU with NUM_SMS SMs; returns the list each decode's plan joins."""
    real_dot, real_plan = attention.decode_uses_dot, attention.plan_decode
    seen: list[attention.DecodePlan] = []

    def plan(*args, **kwargs):
        p = real_plan(*args, **kwargs)
        seen.append(p)
        return p

    monkeypatch.setattr(attention, "parallelism", lambda: NUM_SMS)
    monkeypatch.setattr(attention, "decode_uses_dot",
                        lambda group_size, interpret, dtype_bytes=2: real_dot(group_size, False, dtype_bytes))
    monkeypatch.setattr(attention, "plan_decode", plan)
    return seen


def _inputs(num_seqs: int, layout: str, dtype: torch.dtype, seed: int):
    hq, hkv = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_seqs * WIDTH + 1
    table = torch.randperm(num_blocks, generator=gen)[: num_seqs * WIDTH].to(torch.int32).reshape(num_seqs, WIDTH)
    lens = [WIDTH * BS - 7 * s if s % 2 == 0 else 1 + 37 * s for s in range(num_seqs)]  # long and short
    cache = (num_blocks, BS, hkv, D)
    return {"q": (torch.randn(num_seqs, hq, D, generator=gen) * 2).to(dtype),
            "k_cache": torch.randn(cache, generator=gen).to(dtype),
            "v_cache": torch.randn(cache, generator=gen).to(dtype),
            "block_tables": table, "seq_lens": torch.tensor(lens, dtype=torch.int32)}


def _run(x, case: str):
    out = torch.full_like(x["q"], math.nan)
    got = kernels.paged_decode(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], out=out)
    ref = oracle.decode(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"])
    tol = TOLERANCES[x["q"].dtype]
    err = (got.double() - ref.out).abs()
    assert torch.isfinite(got).all(), f"{case}: non-finite output"
    assert err.max() <= tol.max_abs and err.norm() <= tol.rel * ref.out.norm(), (
        f"{case}: max abs {err.max():.3e} (bound {tol.max_abs}), "
        f"rel {err.norm() / ref.out.norm():.3e} (bound {tol.rel})")


def test_each_dispatch_path_is_reached_and_matches_the_oracle(plans):
    taken: dict[tuple[bool, bool], list[str]] = {}
    for i, (num_seqs, layout, dt) in enumerate(CASES):
        case = f"decode/seqs={num_seqs},{layout},{dt}"
        _run(_inputs(num_seqs, layout, DTYPES[dt], seed=i), case)
        plan = plans[-1]
        taken.setdefault((plan.tiles.use_dot, plan.num_splits > 1), []).append(case)
        # the rules, restated: which path this call must have taken
        want_dot = dt == "fp16" and LAYOUTS[layout][0] // LAYOUTS[layout][1] >= attention.MIN_DOT_GROUP
        assert plan.tiles.use_dot == want_dot, f"{case}: use_dot {plan.tiles.use_dot}"
        assert (plan.num_splits > 1) == (num_seqs < SWITCH), f"{case}: num_splits {plan.num_splits}"
    missing = {(d, s) for d in (False, True) for s in (False, True)} - set(taken)
    assert not missing, f"paths never reached (use_dot, split): {sorted(missing)}; reached: {taken}"
