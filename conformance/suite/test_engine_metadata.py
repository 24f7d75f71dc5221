"""Every step of a few engine runs replayed on the implementation: block tables, slot mappings,
``seq_lens`` and ``cu_seqlens_q`` from our engine's scheduler and step-input path (``gate.engine_steps``),
K/V and queries fresh ``randn`` (never zeros) for each step's tokens.

Per step, as the engine runs it: the copy-on-write copies (``copy_blocks``), ``write_kv`` of the step's
new tokens through the slot mapping, then ``paged_decode`` when every chunk is one token, else
``paged_prefill``. The output is judged against the float64 oracle over the suite's own copy of the
cache, written independently, and the implementation's cache after its own copies and writes against
that copy, bit for bit; the implementation's cache starts NaN, so a read (or a write) of a slot no step
wrote shows.

Each implementation is judged on the parts it implements, so that one kernel of an engine (a decode
kernel, a prefill kernel, a cache write) is judged on the same engine runs as a whole backend: copies
and writes it lacks are done by the suite on its cache, and a step whose attention call it lacks is
attended by nobody (its K/V still go in, for the steps after). Scenarios come with blocks of 4 and of 16
(``gate.engine_steps``): kernels that take only multiples of 16 run the second set.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch
from pagedbench.conformance import capabilities
from pagedbench.conformance.adapter import NotSupported
from pagedbench.conformance.gate import checks, engine_steps, oracle
from pagedbench.conformance.gate.cases import DTYPES, TOLERANCES


@dataclass(frozen=True, slots=True)
class EngineCase:
    """A scenario replayed with one attention shape."""

    scenario: engine_steps.EngineScenario
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "fp16"

    @property
    def id(self) -> str:
        return (f"engine/{self.scenario.id},hq={self.num_heads},hkv={self.num_kv_heads},d={self.head_dim},"
                f"{self.dtype}")


_BY_NAME = {s.name: s for s in engine_steps.SCENARIOS_BS4}
CASES = [EngineCase(s) for s in engine_steps.SCENARIOS]
SLOW_CASES = [EngineCase(s, dtype=d) for s in engine_steps.SCENARIOS for d in ("fp32", "bf16")]
SLOW_CASES += [EngineCase(_BY_NAME["fork-n3"], num_heads=16, num_kv_heads=1, head_dim=64),
               EngineCase(_BY_NAME["prefix-hit"], num_heads=8, num_kv_heads=8, head_dim=16)]


def _copy(cache_k, cache_v, pairs: torch.Tensor) -> None:
    src, dst = pairs[:, 0], pairs[:, 1]
    cache_k[dst], cache_v[dst] = cache_k[src].clone(), cache_v[src].clone()


def _write(cache_k, cache_v, k, v, slots: torch.Tensor) -> None:
    bs = cache_k.shape[1]
    cache_k[slots // bs, slots % bs] = k
    cache_v[slots // bs, slots % bs] = v


def _attend(impl, step: engine_steps.EngineStep, q, k_cache, v_cache, tables, seq_lens, cu, *, scale, out):
    """The step's attention call as the engine makes it: ``paged_decode`` when every chunk is one token."""
    if step.decode_only:
        return impl.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale=scale, out=out)
    return impl.paged_prefill(q, k_cache, v_cache, tables, seq_lens, cu, scale=scale, out=out)


def replay(impl, case: EngineCase) -> int:
    """Run every step of ``case``'s scenario on ``impl``; raises AssertionError at the first step whose
    output (or cache) is off. Returns the number of steps in which something ``impl`` did was judged.

    ``impl`` is judged on the parts it implements: a part that raises ``NotSupported`` (``copy_blocks``,
    ``write_kv``, the step's ``paged_decode`` or ``paged_prefill``) is done by the suite on the
    implementation's cache (copies, writes) or by nobody (attention: the step's K/V are still written, so
    later steps read them), and is recorded as unchecked. A copy or write the implementation made is
    judged by its whole cache, bit for bit against the suite's (NaN where nothing was written); its
    attention against the oracle. A case in which it did nothing at all is "not supported", never a pass.
    """
    dtype = DTYPES[case.dtype]
    if dtype not in impl.dtypes or dtype not in impl.capabilities.dtypes:
        pytest.skip(f"not supported: {impl.name} does not claim {case.dtype}")
    sc = case.scenario
    blocks = impl.capabilities.block_sizes
    if blocks is not None and sc.block_size not in blocks:
        pytest.skip(f"not supported: {impl.name} does not support block_size {sc.block_size}")
    steps = engine_steps.record(sc)
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    dev, hkv, d = impl.device, case.num_kv_heads, case.head_dim
    shape = (sc.num_blocks, sc.block_size, hkv, d)
    k_cache = torch.full(shape, math.nan, dtype=dtype, device=dev)
    v_cache = torch.full_like(k_cache, math.nan)
    truth_k, truth_v = torch.full(shape, math.nan, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)
    tol, scale = TOLERANCES[dtype], oracle.default_scale(d)
    judged_steps = 0
    for i, step in enumerate(steps):
        context = f"{case.id},step={i}"
        cache_judged = False
        if len(step.copies):
            pairs = torch.from_numpy(step.copies)
            try:
                impl.copy_blocks(k_cache, v_cache, pairs.to(dev))
                cache_judged = True
            except NotSupported:
                capabilities.note_unchecked("copy_blocks")
                _copy(k_cache, v_cache, pairs.to(dev))
            _copy(truth_k, truth_v, pairs)
        num_tokens = len(step.slot_mapping)
        k = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
        v = torch.randn(num_tokens, hkv, d, generator=gen).to(dtype)
        q = torch.randn(num_tokens, case.num_heads, d, generator=gen).to(dtype)
        slots = torch.from_numpy(step.slot_mapping)
        try:
            impl.write_kv(k.to(dev), v.to(dev), k_cache, v_cache, slots.to(dev))
            cache_judged = True
        except NotSupported:
            capabilities.note_unchecked("write_kv")
            _write(k_cache, v_cache, k.to(dev), v.to(dev), slots.to(dev))
        _write(truth_k, truth_v, k, v, slots)
        if cache_judged:  # what its copies and writes left, every slot: the written ones and the NaN rest
            for name, mine, truth in (("k_cache", k_cache, truth_k), ("v_cache", v_cache, truth_v)):
                checks.assert_bitwise_equal(mine, truth, what=f"{name} after the step's copies and writes",
                                            context=context)
        tables = torch.from_numpy(step.block_tables)
        seq_lens = torch.from_numpy(step.seq_lens).to(torch.int32)
        cu = torch.from_numpy(step.cu_seqlens_q)
        op = "decode" if step.decode_only else "prefill"
        out = torch.full_like(q, math.nan).to(dev)
        try:
            got = _attend(impl, step, q.to(dev), k_cache, v_cache, tables.to(dev), seq_lens.to(dev), cu.to(dev),
                          scale=scale, out=out)
        except NotSupported:  # judged on its other parts; this step's attention is done by nobody
            capabilities.note_unchecked(f"paged_{op}")
            judged_steps += cache_judged
            continue
        if step.decode_only:
            ref = oracle.decode(q, truth_k, truth_v, tables, seq_lens, scale=scale)
        else:
            ref = oracle.prefill(q, truth_k, truth_v, tables, seq_lens, cu, scale=scale)
        if not torch.isfinite(ref.out).all():  # the engine's own metadata is wrong, whatever the implementation
            raise AssertionError(f"{context}: the step's tables reach a slot its slot mappings never wrote")
        for what, tensor in ((f"{op}_out", got), (f"{op}_out_buffer", out)):  # returned, and written to out=
            checks.check_tensor(tensor, ref.out, dtype, rel=tol.rel, max_abs=tol.max_abs, what=what,
                                context=context)
        judged_steps += 1
    if not judged_steps:
        pytest.skip(f"not supported: {impl.name} implements none of copy_blocks, write_kv, paged_decode, "
                    f"paged_prefill for this run's steps")
    return judged_steps


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_engine_steps_match_oracle(impl, case):
    """Each step of an engine run (prefix hit, chunked prefill, fork with copy-on-write, preemption and
    resume), replayed with random K/V, gives the oracle's attention and the suite's cache."""
    assert replay(impl, case) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=[c.id for c in SLOW_CASES])
def test_engine_steps_match_oracle_more_shapes(impl, case):
    assert replay(impl, case) >= 1
