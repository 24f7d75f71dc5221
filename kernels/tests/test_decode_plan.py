"""Split-K decode is observable: a forced ``num_splits`` launches that many programs per (sequence, KV
head), whose partial LSEs the reduction merges; the heuristic splits few long sequences; and the
default ``scale`` (``1/sqrt(head_dim)``) is the one the oracle assumes.

The reduction kernel is wrapped to record its partial buffers, and the heuristic is made to pick another
count than the forced one: a launcher that ignored the forced split count (or never split) would launch
no reduction, or one over another number of partials.
"""

from __future__ import annotations

import pytest
import torch
from pagedbench import kernels
from pagedbench.conformance.gate import oracle
from pagedbench.kernels import attention

BS, HKV, HQ, D = 16, 1, 2, 16
MAX_BLOCKS = 40  # capacity 640 keys: 3 key tiles of 256 under the interpreter


def _long_sequence(seq_len: int = 600, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(MAX_BLOCKS, generator=gen).to(torch.int32)[None]
    return {
        "q": torch.randn(1, HQ, D, generator=gen) * 3,  # peaky: every split's keys matter
        "k_cache": torch.randn(MAX_BLOCKS, BS, HKV, D, generator=gen),
        "v_cache": torch.randn(MAX_BLOCKS, BS, HKV, D, generator=gen),
        "block_tables": table,
        "seq_lens": torch.tensor([seq_len], dtype=torch.int32),
    }


class _RecordingReduce:
    """Stands in for ``_decode_reduce_kernel``: records each launch's partial LSE, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.partial_lse = kernel, []

    def __getitem__(self, grid):
        def launch(part_out, part_lse, *args, **kwargs):
            self.partial_lse.append(part_lse.clone())
            return self.kernel[grid](part_out, part_lse, *args, **kwargs)
        return launch


@pytest.fixture
def reduce_launches(monkeypatch):
    recorder = _RecordingReduce(attention._decode_reduce_kernel)
    monkeypatch.setattr(attention, "_decode_reduce_kernel", recorder)
    return recorder.partial_lse


def _decode(x, **kw):
    return kernels.paged_decode(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], **kw)


def _check_exact(x, out):
    ref = oracle.decode(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"])
    torch.testing.assert_close(out.double(), ref.out, rtol=1e-5, atol=1e-4)


@pytest.fixture
def heuristic_picks(monkeypatch):
    """Makes the split heuristic pick a given count, so a forced count it would not pick shows whether the
    launcher honoured it (left alone, the heuristic picks 2 for this sequence under the interpreter)."""

    def pick(count: int) -> None:
        monkeypatch.setattr(attention, "choose_num_splits", lambda *args, **kwargs: count)

    return pick


@pytest.mark.parametrize("num_splits, heuristic", [(2, 1), (2, 3), (3, 1), (3, 2)])
def test_a_forced_split_count_runs_that_many_partials(reduce_launches, heuristic_picks, num_splits, heuristic):
    heuristic_picks(heuristic)
    x = _long_sequence()
    out = _decode(x, num_splits=num_splits)
    assert len(reduce_launches) == 1, "the forced split count was ignored: no reduction ran"
    part_lse = reduce_launches[0]
    assert part_lse.shape == (1, HQ, num_splits)
    assert torch.isfinite(part_lse).all(), "every split of a 600-key sequence has keys"
    _check_exact(x, out)


@pytest.mark.parametrize("heuristic", [2, 3])
def test_one_split_runs_no_reduction(reduce_launches, heuristic_picks, heuristic):
    heuristic_picks(heuristic)
    x = _long_sequence()
    _check_exact(x, _decode(x, num_splits=1))
    assert reduce_launches == []


class _PaddedPartials:
    """Stands in for ``_decode_reduce_kernel``: hands it the partial outputs as a view into a NaN-filled
    buffer with one spare split and spare dims, so a read of a split lane past ``num_splits`` (a power-of-
    two tile of 3 splits has a fourth lane) meets NaN, which a zero weight does not cancel."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(part_out, part_lse, out, lse, num_splits, head_dim, *strides, **kwargs):
            s, h, n, d = part_out.shape
            padded = torch.full((s, h, n + 1, d + 8), float("nan"), dtype=part_out.dtype)[:, :, :n, :d]
            padded.copy_(part_out)
            return self.kernel[grid](padded, part_lse, out, lse, num_splits, head_dim, *padded.stride(),
                                     *strides[4:], **kwargs)
        return launch


def test_the_reduction_reads_only_its_splits(monkeypatch):
    monkeypatch.setattr(attention, "_decode_reduce_kernel", _PaddedPartials(attention._decode_reduce_kernel))
    x = _long_sequence()
    _check_exact(x, _decode(x, num_splits=3))


def test_the_heuristic_splits_few_long_sequences():
    assert attention.choose_num_splits(1, 1, 4096, num_sms=132) > 1
    assert attention.choose_num_splits(2, 8, 32768, num_sms=132) == attention.MAX_SPLITS
    assert attention.choose_num_splits(64, 8, 4096, num_sms=132) == 1  # the grid already fills the SMs
    assert attention.choose_num_splits(1, 1, attention.MIN_KEYS_PER_SPLIT, num_sms=132) == 1  # too short
    assert attention.choose_num_splits(2, 1, 4096, num_sms=1) == 1  # two programs already fill one


def test_the_default_split_count_follows_the_heuristic(reduce_launches, monkeypatch):
    """With the parallelism of a GPU, one 600-key sequence is split by default, into as many partials
    as the plan says, and still matches the oracle."""
    monkeypatch.setattr(attention, "parallelism", lambda: 132)
    x = _long_sequence()
    plan = attention.plan_decode(1, HKV, HQ // HKV, D, MAX_BLOCKS * BS, None, interpret=True, num_sms=132)
    assert plan.num_splits > 1
    _check_exact(x, _decode(x))
    assert [p.shape[-1] for p in reduce_launches] == [plan.num_splits]


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_default_scale_is_one_over_sqrt_head_dim(op):
    """Peaky queries, so any other default (1, 1/head_dim) is far outside the float32 bound."""
    x = _long_sequence(seq_len=37, seed=1)
    x["q"] = x["q"] * 3
    args = (x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"])
    if op == "decode":
        out, ref = _decode(x), oracle.decode(x["q"], *args, scale=D**-0.5)
    else:
        q = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(2)) * 9
        cu = torch.tensor([0, 5], dtype=torch.int32)
        out, ref = kernels.paged_prefill(q, *args, cu), oracle.prefill(q, *args, cu, scale=D**-0.5)
    torch.testing.assert_close(out.double(), ref.out, rtol=1e-5, atol=1e-4)
