"""The engine-metadata family judges each implementation on the parts it implements: a decode kernel on
the decode steps, a prefill kernel on the prefill steps, a cache write on its cache, with the suite doing
the copies and writes an implementation lacks; a wrong part fails, and an implementation that does none
of a run's parts is "not supported", never a pass.

The fakes delegate the parts they keep to our torch reference and lack the rest (the base adapter's
``NotSupported``).
"""

from __future__ import annotations

import pytest
import torch
from pagedbench.conformance import capabilities
from pagedbench.conformance.adapter import Implementation
from pagedbench.conformance.implementations import TorchReferenceImplementation
from pagedbench.conformance.suite.test_engine_metadata import CASES, EngineCase, replay

TORCH = TorchReferenceImplementation()
BY_ID = {c.scenario.id: c for c in CASES}
FORK = BY_ID["fork-n3,bs=4,blocks=32"]
FORK16 = BY_ID["fork-n3,bs=16,blocks=12"]


def _steps(case: EngineCase, *, decode: bool) -> int:
    from pagedbench.conformance.gate import engine_steps

    return sum(s.decode_only == decode for s in engine_steps.record(case.scenario))


class DecodeOnly(Implementation):
    name = "fake-decode-only"

    def paged_decode(self, *args, **kwargs):
        return TORCH.paged_decode(*args, **kwargs)


class PrefillOnly(Implementation):
    name = "fake-prefill-only"

    def paged_prefill(self, *args, **kwargs):
        return TORCH.paged_prefill(*args, **kwargs)


class WriteOnly(Implementation):
    name = "fake-write-only"

    def write_kv(self, *args, **kwargs):
        return TORCH.write_kv(*args, **kwargs)


class AllButWrite(Implementation):
    name = "fake-all-but-write"

    def paged_decode(self, *args, **kwargs):
        return TORCH.paged_decode(*args, **kwargs)

    def paged_prefill(self, *args, **kwargs):
        return TORCH.paged_prefill(*args, **kwargs)

    def copy_blocks(self, *args, **kwargs):
        return TORCH.copy_blocks(*args, **kwargs)


class Nothing(Implementation):
    name = "fake-nothing"


class CopyOnly(Implementation):
    name = "fake-copy-only"

    def copy_blocks(self, *args, **kwargs):
        return TORCH.copy_blocks(*args, **kwargs)


def _unchecked() -> list[str]:
    """What the replay in this test recorded as left to the suite (and forgets it)."""
    from pagedbench.conformance.gate.checks import _current_test

    return capabilities.take_unchecked(_current_test())


@pytest.mark.parametrize("case", [FORK, FORK16], ids=lambda c: c.id)
def test_a_decode_kernel_is_judged_on_the_decode_steps(case):
    assert replay(DecodeOnly(), case) == _steps(case, decode=True) >= 2
    assert _unchecked() == ["copy_blocks", "paged_prefill", "write_kv"]


def test_a_prefill_kernel_is_judged_on_the_prefill_steps():
    assert replay(PrefillOnly(), FORK16) == _steps(FORK16, decode=False) >= 2
    assert _unchecked() == ["copy_blocks", "paged_decode", "write_kv"]


def test_a_cache_write_is_judged_on_every_step():
    case = BY_ID["preempt-resume,bs=16,blocks=5"]
    assert replay(WriteOnly(), case) == _steps(case, decode=True) + _steps(case, decode=False)
    assert _unchecked() == ["paged_decode", "paged_prefill"]


def test_without_write_kv_the_suite_writes_and_the_rest_is_judged():
    assert replay(AllButWrite(), FORK) == _steps(FORK, decode=True) + _steps(FORK, decode=False)
    assert _unchecked() == ["write_kv"]


def test_an_implementation_of_none_of_the_parts_is_not_supported():
    with pytest.raises(pytest.skip.Exception, match=r"^not supported: fake-nothing implements none"):
        replay(Nothing(), FORK16)
    _unchecked()


def test_copies_alone_are_judged_where_a_run_copies_and_not_supported_where_it_does_not():
    assert replay(CopyOnly(), FORK16) == 1  # the one step of the run that copies (two copies of one block)
    with pytest.raises(pytest.skip.Exception, match=r"^not supported"):
        replay(CopyOnly(), BY_ID["prefix-hit,bs=16,blocks=12"])
    _unchecked()


def _off_by(x: torch.Tensor) -> torch.Tensor:
    x[..., 0, 0] += 0.25  # one head's first element of every row
    return x


class WrongDecode(DecodeOnly):
    def paged_decode(self, *args, **kwargs):
        return _off_by(TORCH.paged_decode(*args, **kwargs))


class WrongPrefill(PrefillOnly):
    def paged_prefill(self, *args, **kwargs):
        return _off_by(TORCH.paged_prefill(*args, **kwargs))


class WriteSkipsLastToken(WriteOnly):
    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        return TORCH.write_kv(k[:-1], v[:-1], k_cache, v_cache, slot_mapping[:-1])


class WriteIntoTheNextSlotToo(WriteOnly):
    """Writes every token right, and its key again one slot on: a slot no step wrote gets a value."""

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        TORCH.write_kv(k, v, k_cache, v_cache, (slot_mapping + 1) % k_cache[..., 0, 0].numel())
        return TORCH.write_kv(k, v, k_cache, v_cache, slot_mapping)


class CopyDropsTheLastPair(CopyOnly):
    def copy_blocks(self, k_cache, v_cache, pairs):
        return TORCH.copy_blocks(k_cache, v_cache, pairs[:-1])  # the fork step copies one block twice


@pytest.mark.parametrize("fake,case,match", [
    (WrongDecode(), FORK16, "decode_out"),
    (WrongPrefill(), FORK16, "prefill_out"),
    (WriteSkipsLastToken(), FORK16, "k_cache after the step's copies and writes"),
    (WriteIntoTheNextSlotToo(), FORK, "k_cache after the step's copies and writes"),
    (CopyDropsTheLastPair(), FORK16, "k_cache after the step's copies and writes"),
], ids=lambda x: type(x).__name__ if isinstance(x, Implementation) else None)
def test_a_wrong_part_fails(fake, case, match):
    with pytest.raises(AssertionError, match=match):
        replay(fake, case)
    _unchecked()
