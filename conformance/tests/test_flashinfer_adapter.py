"""The FlashInfer adapter where there is no CUDA: it says "not supported: needs CUDA" (when built, in the
gate's preflight, and as its matrix row). The parts it computes itself --
the CSR page table from our block tables, the window bound, the log2 <-> natural-log LSE conversions --
are checked without FlashInfer, against its documented conventions (a float64 stand-in for its log2
``merge_state``). None of this needs the peers venv.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from pagedbench.conformance.adapter import NotSupported
from pagedbench.conformance.gate import matrix
from pagedbench.conformance.gate.matrix_markdown import render
from pagedbench.conformance.peers import flashinfer_paged
from pagedbench.kernels import reference

LOAD = "pagedbench.conformance.peers.flashinfer_paged"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the adapter runs here")


@no_cuda
def test_building_it_without_cuda_raises_not_supported_needs_cuda():
    assert flashinfer_paged.missing() == "needs CUDA"
    with pytest.raises(NotSupported, match=r"^needs CUDA$"):
        flashinfer_paged.FlashInferPaged()


@no_cuda
def test_the_gate_says_not_supported_needs_cuda_once_and_writes_nothing(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "pagedbench.conformance", "--impl", "flashinfer", "--load", LOAD,
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert lines == [
        "conformance gate [flashinfer]: environment error: 'flashinfer': not supported: needs CUDA; "
        "nothing was run or written"
    ]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


@no_cuda
def test_its_matrix_row_says_not_supported_needs_cuda(tmp_path):
    assert matrix.main(["--dir", str(tmp_path), "--not-supported", f"flashinfer={flashinfer_paged.missing()}"]) == 0
    row = next(line for line in (tmp_path / "matrix.md").read_text().splitlines() if line.startswith("| flashinfer"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "flashinfer" and cells[2:-1] == ["not supported: needs CUDA"] * (len(matrix.PROPERTIES) + 1)
    built = matrix.build(tmp_path, [], [], not_supported={"flashinfer": "needs CUDA"})
    assert built["implementations"] == [{"name": "flashinfer", "status": "not supported", "reason": "needs CUDA"}]
    assert "not supported: needs CUDA" in render(built)


def test_a_malformed_not_supported_row_is_refused(capsys):
    with pytest.raises(SystemExit):
        matrix.main(["--not-supported", "flashinfer"])
    assert "expected NAME=REASON, got 'flashinfer'" in capsys.readouterr().err


def test_the_page_table_lists_each_sequences_blocks_and_its_last_blocks_fill():
    tables = torch.tensor([[7, 2, 9, 0], [4, 0, 0, 0], [1, 3, 5, 6]], dtype=torch.int32)
    lens = torch.tensor([33, 16, 49], dtype=torch.int32)  # 3 blocks (1 in the last), 1 full, 4 (1 in the last)
    indptr, indices, last = flashinfer_paged.page_table(tables, lens, block_size=16)
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [7, 2, 9, 4, 1, 3, 5, 6]
    assert last.tolist() == [1, 16, 1]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}


def test_a_window_of_w_keys_is_flashinfers_inclusive_left_bound_w_minus_1():
    assert flashinfer_paged.window_left(None) == -1
    assert flashinfer_paged.window_left(5) == 4


class _Log2MergeState:
    """FlashInfer's ``merge_state`` convention, in float64: LSEs in base 2."""

    @staticmethod
    def merge_state(v_a, s_a, v_b, s_b):
        s = torch.logaddexp2(s_a.double(), s_b.double())
        w_a, w_b = torch.exp2(s_a.double() - s)[..., None], torch.exp2(s_b.double() - s)[..., None]
        return (w_a * v_a.double() + w_b * v_b.double()).to(v_a.dtype), s.float()


def test_lses_cross_to_and_from_flashinfers_log2_as_natural_logs():
    impl = object.__new__(flashinfer_paged.FlashInferPaged)  # no CUDA needed for the conversions
    impl._flashinfer = _Log2MergeState()
    gen = torch.Generator().manual_seed(0)
    out_a, out_b = (torch.randn(5, 3, 8, generator=gen) for _ in range(2))
    lse_a, lse_b = torch.randn(5, 3, generator=gen) * 4, torch.randn(5, 3, generator=gen) * 4
    out, lse = impl.merge_attn_states(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = reference.merge_attn_states(out_a.double(), lse_a.double(), out_b.double(), lse_b.double())
    assert (lse.double() - want_lse).abs().max() < 1e-5
    assert (out.double() - want_out).abs().max() < 1e-5
    given_out, given_lse = torch.full_like(out_a, math.nan), torch.full_like(lse_a, math.nan)
    got = impl.merge_attn_states(out_a, lse_a, out_b, lse_b, out=given_out, out_lse=given_lse)
    assert got[0] is given_out and got[1] is given_lse and torch.equal(given_out, out) and torch.equal(given_lse, lse)
    log2_lse = torch.tensor([[1.0, -2.0]])
    assert torch.allclose(impl._natural_lse((out_a, log2_lse), True)[1], log2_lse * math.log(2))
    assert impl._natural_lse(out_a, False) is out_a

