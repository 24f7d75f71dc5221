"""Minimal reproductions of what the matrix found in the outside kernels, run and written to ``findings.md``.

``.peers/bin/python -m pagedbench.conformance.peers.findings [--out results/conformance/findings.md]``
(part of ``make conformance-matrix``). Each finding is a function calling the peer's kernel directly on a
few hand-made tensors, with the import lines a full vLLM / SGLang install would use (here the kernel files
are loaded first by ``conformance.peers.load_kernel_module``, so those lines find them). The file shows
each function's source and what it printed on this machine, beside the peer source lines it points at
(read from the installed files), and whether each finding still reproduces there (each reproduction
returns it), so nothing in it is written by hand: re-run on new peer versions, it says which findings
were fixed and which still stand.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from types import SimpleNamespace

from pagedbench.conformance.gate import report_files
from pagedbench.conformance.peers import (
    _package_dir,
    sglang_decode,
    sglang_merge,
    vllm_cache_write,
    vllm_merge,
    vllm_paged_decode,
    vllm_prefill,
    vllm_unified,
)
from pagedbench.conformance.peers.findings_page import FamilyReview, Finding, attend, render
from pagedbench.conformance.peers.stride_findings import SGLANG_DECODE_FILE, STRIDE_FINDINGS, sglang_decode_one_sequence


def vllm_paged_decode_reads_unused_slots():
    import torch
    from vllm.v1.attention.ops.chunked_prefill_paged_decode import chunked_prefill_paged_decode

    torch.manual_seed(0)
    heads, kv_heads, d, block_size, seq_len = 4, 2, 64, 16, 3
    q = torch.randn(1, heads, d, dtype=torch.float16)
    k = torch.randn(1, block_size, kv_heads, d, dtype=torch.float16)  # one block: [blocks, slots, kv_heads, d]
    v = torch.randn_like(k)
    x = 16 // k.element_size()
    scale = d**-0.5

    def run(k, v):
        out, one = torch.empty_like(q), torch.ones(1)
        chunked_prefill_paged_decode(
            query=q,
            key=q[:, :kv_heads],
            value=q[:, :kv_heads],
            output=out,
            kv_cache_dtype="auto",
            key_cache=k.view(1, block_size, kv_heads, d // x, x).permute(0, 2, 3, 1, 4),  # [b, kv, d/x, slot, x]
            value_cache=v.permute(0, 2, 3, 1),  # [b, kv, d, slot]
            block_table=torch.tensor([[0]], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            max_seq_len=seq_len,
            max_query_len=1,
            k_scale=one,
            v_scale=one,
            sm_scale=scale,
        )
        return out

    want = attend(q[0], k[0, :seq_len], v[0, :seq_len], scale)
    print("finite values in slots 3..15: max |error| =", f"{(run(k, v)[0].double() - want).abs().max().item():.1e}")
    k[0, seq_len:], v[0, seq_len:] = float("nan"), float("nan")  # slots past the sequence's 3 tokens
    poisoned = run(k, v).isnan().any().item()
    print("NaN in slots 3..15 (never part of the sequence): output has NaN =", poisoned)
    return poisoned


def vllm_rocm_window_is_one_key_short():
    import torch
    from vllm.v1.attention.ops.chunked_prefill_paged_decode import chunked_prefill_paged_decode

    torch.manual_seed(0)
    heads, kv_heads, d, block_size, seq_len, window = 4, 2, 64, 16, 12, 5
    q = torch.randn(1, heads, d, dtype=torch.float16)
    k = torch.randn(1, block_size, kv_heads, d, dtype=torch.float16)
    v = torch.randn_like(k)
    x, scale = 16 // k.element_size(), d**-0.5

    def run(sliding_window):
        out, one = torch.empty_like(q), torch.ones(1)
        chunked_prefill_paged_decode(
            query=q,
            key=q[:, :kv_heads],
            value=q[:, :kv_heads],
            output=out,
            kv_cache_dtype="auto",
            key_cache=k.view(1, block_size, kv_heads, d // x, x).permute(0, 2, 3, 1, 4),
            value_cache=v.permute(0, 2, 3, 1),
            block_table=torch.tensor([[0]], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            max_seq_len=seq_len,
            max_query_len=1,
            k_scale=one,
            v_scale=one,
            sliding_window=sliding_window,
            sm_scale=scale,
        )
        return out[0].double()

    for keys in (window, window - 1):  # attention over the last `keys` tokens
        ref = attend(q[0], k[0, seq_len - keys : seq_len], v[0, seq_len - keys : seq_len], scale)
        for arg in (window, window - 1):
            print(
                f"sliding_window={arg}: max |error| against the last {keys} keys = {(run(arg) - ref).abs().max():.1e}"
            )
    # what RocmAttentionImpl passes for a model window of `window` keys, read from the installed backend
    passed = backend_keyword_value(
        "vllm/v1/attention/backends/rocm_attn.py", "chunked_prefill_paged_decode", "sliding_window",
        self_attrs={"sliding_window": (window - 1, 0)},
    )  # fmt: skip
    print(f"RocmAttentionImpl passes sliding_window={passed[0]} = {passed[1]} for a window of {window} keys")
    return passed[1] != window


def zero_length_sequence_gives_nan():
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    torch.manual_seed(0)
    heads, kv_heads, d, block_size = 4, 2, 64, 16
    lens = torch.tensor([0, 5], dtype=torch.int32)  # the first sequence has no token yet
    q = torch.randn(2, heads, d, dtype=torch.float16)
    k = torch.randn(2, block_size, kv_heads, d, dtype=torch.float16)  # sequence s uses block s
    v = torch.randn_like(k)
    scale = d**-0.5

    out = torch.empty_like(q)
    descale = torch.ones(2, kv_heads)
    unified_attention(
        q,
        k,
        v,
        out,
        cu_seqlens_q=torch.arange(3, dtype=torch.int32),
        max_seqlen_q=1,
        seqused_k=lens,
        max_seqlen_k=5,
        softmax_scale=scale,
        causal=True,
        window_size=(-1, -1),
        block_table=torch.tensor([[0], [1]], dtype=torch.int32),
        softcap=0.0,
        q_descale=None,
        k_descale=descale,
        v_descale=descale,
        seq_threshold_3D=128 // kv_heads,  # TritonAttentionBackend's: batches this small take the 3-D path
        num_par_softmax_segments=16,
        softmax_segm_output=torch.empty(2, heads, 16, d),
        softmax_segm_max=torch.empty(2, heads, 16),
        softmax_segm_expsum=torch.empty(2, heads, 16),
    )
    vllm_nan = out.isnan().flatten(1).any(1).tolist()
    print("vLLM unified_attention, rows with NaN:", vllm_nan)

    out, splits = torch.empty_like(q), 8
    decode_attention_fwd(
        q,
        k.view(-1, kv_heads, d),
        v.view(-1, kv_heads, d),
        out,
        kv_indptr=torch.tensor([0, 0, 5], dtype=torch.int32),
        kv_indices=torch.arange(block_size, block_size + 5),  # block 1's slots
        attn_logits=torch.empty(2, heads, splits, d),
        attn_lse=torch.empty(2, heads, splits),
        num_kv_splits=torch.full((2,), splits, dtype=torch.int32),
        max_kv_splits=splits,
        sm_scale=scale,
        k_scale=1.0,
        v_scale=1.0,
    )
    sglang_nan = out.isnan().flatten(1).any(1).tolist()
    print("SGLang decode_attention_fwd, rows with NaN:", sglang_nan)
    print(
        "the non-empty row is right (max |error|):",
        f"{(out[1].double() - attend(q[1], k[1, :5], v[1, :5], scale)).abs().max():.1e}",
    )
    return vllm_nan[0] or sglang_nan[0]


def merges_read_an_empty_parts_output():
    import torch
    from sglang.kernels.ops.attention.merge_state import merge_state_triton
    from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states

    torch.manual_seed(0)
    tokens, heads, d = 2, 4, 32
    out_a, out_b = torch.randn(tokens, heads, d), torch.randn(tokens, heads, d)
    empty = torch.full((tokens, heads), float("-inf"))  # a part with no key (an empty prefix or suffix)
    lse_b = torch.randn(tokens, heads)

    def vllm(out_a, lse_a, lse_b):  # vLLM's LSEs are [heads, tokens]: ours go in transposed
        out, lse = torch.empty_like(out_b), torch.empty(heads, tokens)
        merge_attn_states(out, out_a, lse_a.t(), out_b, lse_b.t(), output_lse=lse)
        return out

    def sglang(out_a, lse_a, lse_b):
        return merge_state_triton(out_a, lse_a, out_b, lse_b)[0]

    shows = False
    for name, merge in (("vLLM merge_attn_states", vllm), ("SGLang merge_state_triton", sglang)):
        print(
            f"{name}: part A empty, its output finite: max |merged - out_b| =",
            f"{(merge(out_a, empty, lse_b) - out_b).abs().max():.1e}",
        )
        nan_a = merge(torch.full_like(out_a, float("nan")), empty, lse_b).isnan().any().item()
        print(f"{name}: part A empty, its output NaN (never to be read): merged has NaN =", nan_a)
        nan_both = merge(out_a, empty, empty).isnan().any().item()
        print(f"{name}: both parts empty, outputs finite: merged has NaN =", nan_both)
        shows = shows or nan_a or nan_both
    return shows


def sglang_grouped_decode_reads_the_wrong_kv_head():
    import torch

    torch.manual_seed(0)
    d, n, splits, scale = 32, 5, 2, 32**-0.5
    shows = False
    for heads, kv_heads in ((32, 2), (34, 2), (40, 2), (17, 1)):  # GQA groups 16, 17, 20, and 17 with one KV head
        q = torch.randn(1, heads, d, dtype=torch.float16)
        k = torch.randn(n, kv_heads, d, dtype=torch.float16)  # one sequence of n tokens: [tokens, kv_heads, d]
        v = torch.randn_like(k)
        out = sglang_decode_one_sequence(q, k, v, splits, scale)
        err = (out[0].double() - attend(q[0], k, v, scale)).abs().amax(-1)
        wrong = [h for h in range(heads) if err[h] > 1e-2]
        print(f"{heads} query heads over {kv_heads} KV heads (group {heads // kv_heads}): wrong heads {wrong}")
        shows = shows or bool(wrong)
    return shows


def backend_keyword_value(relative: str, call: str, keyword: str, self_attrs: dict[str, object]) -> tuple[str, object]:
    """(source, value) of the ``keyword=`` argument of the first ``call(...)`` in an installed peer file,
    evaluated with ``self`` holding ``self_attrs``: what a backend passes to a kernel, read from its source."""
    top, _, rest = relative.partition("/")
    tree = ast.parse((_package_dir(top) / rest).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        name = getattr(node, "func", None)
        name = getattr(name, "id", None) or getattr(name, "attr", None)
        if isinstance(node, ast.Call) and name == call:
            for kw in node.keywords:
                if kw.arg == keyword:
                    source = ast.unparse(kw.value)
                    expression = compile(ast.Expression(kw.value), relative, "eval")
                    return source, eval(expression, {"self": SimpleNamespace(**self_attrs)})
    raise LookupError(f"no {call}(..., {keyword}=...) in {relative}")


PAGED_DECODE_FILE = "vllm/v1/attention/ops/chunked_prefill_paged_decode.py"


FINDINGS = (
    Finding(
        "vLLM `chunked_prefill_paged_decode`: decode reads the unused slots of each sequence's last block",
        "bug",
        "vllm 0.11.0",
        "`kernel_paged_attention_2d` in vLLM 0.11.0 loaded K and V for every slot of a block (its loads were masked "
        "by head dimension only; the lines cited below are the slot masks later releases add) and masked the "
        "scores afterwards, so a NaN or infinity left in a slot past the "
        "sequence's length (a reused block, an uninitialised cache) turns the whole output row into NaN: "
        "`-inf + NaN` in the scores, `0 * NaN` in P·V. `unified_attention` masks these loads (`tile_mask`) "
        "and is not affected. Every decode case of the matrix whose last block is partial fails this way for "
        "`vllm-paged-decode` while it reproduces.",
        vllm_paged_decode_reads_unused_slots,
        (
            # the slot masks of the loads: absent in 0.11.0, whose loads were masked by head dimension only
            (PAGED_DECODE_FILE, "mask=dim_mask[:, None] & kv_load_mask[None, :],"),
            (PAGED_DECODE_FILE, "mask=dim_mask[None, :] & kv_load_mask[:, None],"),
        ),
        families=("test_decode.py",),
    ),
    Finding(
        "vLLM ROCm attention backend: a sliding window of W keys attends to W - 1",
        "bug",
        "vllm 0.11.0",
        "`chunked_prefill_paged_decode(sliding_window=N)` attends to the last N keys (`context_len - pos < N`), "
        "but `RocmAttentionImpl` stores `self.sliding_window = (W - 1, 0)` (FlashAttention's left extent); in "
        "vLLM 0.11.0 it passed that first element, so a model with a window of W keys saw W - 1 of them on "
        "this path, while the unified-attention path of the same class (`window_size=(W - 1, 0)`) saw W. With "
        "`sliding_window=W` the kernel matches the oracle, and that is what the `vllm-paged-decode` adapter "
        "passes: the matrix judges the kernel, and the backend's argument is checked only here (the "
        "reproduction reads it from the installed backend's call and evaluates it for a window of W keys).",
        vllm_rocm_window_is_one_key_short,
        (
            ("vllm/v1/attention/backends/rocm_attn.py", "self.sliding_window = (sliding_window - 1, 0)"),
            ("vllm/v1/attention/backends/rocm_attn.py", "sliding_window=1 + self.sliding_window[0],"),
        ),
    ),
    Finding(
        "vLLM `unified_attention` and SGLang `decode_attention_fwd`: a sequence of length 0 gives NaN",
        "limitation",
        "vllm 0.11.0, sglang 0.5.3",
        "Both divide by a softmax sum that is 0 when a sequence has no key (vLLM's 3-D decode path, "
        "`tiles_per_segment = 0`; SGLang's stage 2, `acc / e_sum` with `e_sum = 0`); our contract defines "
        "that row as 0 (`chunked_prefill_paged_decode` gives 0). Their own callers never pass such a row: "
        "padded CUDA-graph batches get length 1 (cited below), so this is a difference of contract, not a "
        "bug in their servers; an engine that pads with length 0 would get NaN rows.",
        zero_length_sequence_gives_nan,
        (
            ("vllm/v1/attention/backends/triton_attn.py", "attn_metadata.seq_lens.fill_(1)"),
            ("sglang/srt/layers/attention/triton_backend.py", "def get_cuda_graph_seq_len_fill_value(self):"),
        ),
        families=("test_decode.py",),
    ),
    Finding(
        "vLLM `merge_attn_states` and SGLang `merge_state_triton`: an empty part's output is read",
        "limitation",
        "vllm 0.33.0, sglang 0.5.23",
        "Both merges weigh each part by `exp(lse - max_lse)`, so a part with LSE `-inf` (no key: an empty "
        "prefix or suffix) gets weight 0, but its output is still loaded and multiplied by that 0: a NaN "
        "there (what an attention over no key gives without special care, as `unified_attention` does for a "
        "length-0 row, finding 3) makes the merged row NaN. Our contract never reads such a part. vLLM's "
        "kernel gives 0 when both parts are empty; SGLang's gives NaN then even from finite outputs "
        "(`0 / 0` in its scales). Backends whose attention writes 0 for empty rows and never merges two "
        "empty parts never meet this. Found by the matrix's merge family (`vllm-merge`, `sglang-merge`: "
        "the `empty-a`, `empty-both` and `mixed-inf` cases).",
        merges_read_an_empty_parts_output,
        (
            ("vllm/v1/attention/ops/triton_merge_attn_states.py", "out = p_out * p_scale + s_out * s_scale"),
            ("sglang/kernels/ops/attention/merge_state.py", "out = p_out * p_scale + s_out * s_scale"),
        ),
        families=("test_merge_states.py",),
    ),
    Finding(
        "SGLang `decode_attention_fwd`: GQA groups past 16 that are not a multiple of 16 read another KV head",
        "bug",
        "sglang 0.5.23",
        "The grouped decode kernel (`_fwd_grouped_kernel_stage1`) gives each KV head `cdiv(kv_group_num, "
        "BLOCK_H)` head tiles of `BLOCK_H = 16` heads, but numbers the heads of tile `t` from `t * 16` "
        "whatever KV head the tile belongs to (`cur_head = cur_head_id * VALID_BLOCK_H + ...`, "
        "`cur_kv_head = cur_head_id // cdiv(kv_group_num, BLOCK_H)`). With a group of 17 to 31 (or any "
        "group past 16 that 16 does not divide) and two or more KV heads, the tiles stop lining up with the "
        "groups: the second tile of KV head 0 covers heads 16-31, of which 17-31 belong to KV head 1, so "
        "they attend with KV head 0's keys and values, and no tile computes them with KV head 1's. One KV "
        "head, or groups of up to 16 or of a multiple of 16, are right. A model with, on one rank, two or more "
        "KV heads and such a group (e.g. 40 query heads over 2 KV heads: group 20) gets wrong attention in "
        "every decode step. Found by the matrix's "
        "dispatch family (`sglang-decode` declares the grouped kernel's head tile, a group of 17, as a "
        "switch).",
        sglang_grouped_decode_reads_the_wrong_kv_head,
        (
            (SGLANG_DECODE_FILE, "cur_kv_head = cur_head_id // tl.cdiv(kv_group_num, BLOCK_H)"),
            (SGLANG_DECODE_FILE, "cur_head = cur_head_id * VALID_BLOCK_H + tl.arange(0, BLOCK_H)"),
            (SGLANG_DECODE_FILE, "return triton.cdiv(head_num, min(_GROUPED_BLOCK_H, kv_group_num))"),
        ),
        families=("test_dispatch_boundaries.py",),
    ),
    *STRIDE_FINDINGS,
)

#: the families whose peer results were read for findings (beside those the findings name), with what the
#: page should say about the peers they cannot judge
REVIEWS = (
    FamilyReview(
        "test_fp8_kv.py",
        "Of the peers only `vllm-unified` declares fp8 KV caches (its kernel reads `stored * k_descale`, "
        "our convention): it has no `write_kv` or `copy_blocks`, and its backend refuses the family's blocks "
        "of 5 and 8, so only the attention cases with blocks of 16 judge it; its bfloat16 misses there are "
        "the interpreter's (a bfloat16 cache without fp8 gives the same). `vllm-cache-write` stores "
        "`x / k_scale` too but is not declared (see its adapter).",
    ),
    FamilyReview(
        "test_strided_layouts.py",
        "What the peers' kernels take no stride for is refused by their "
        "adapters (the findings); `vllm-unified` and `vllm-paged-decode` are judged on none of the "
        "family's cases, which use blocks of 8 (their backends want multiples of 16) and float32 "
        "(`vllm-paged-decode` claims 16-bit types only).",
    ),
    FamilyReview(
        "test_batch_positions.py",
        "`vllm-unified` and `vllm-paged-decode` are judged on none of its "
        "cases (blocks of 8 for `vllm-unified`, float32 for `vllm-paged-decode`); `vllm-prefill` passes its prefill "
        "cases and `sglang-decode` its decode cases.",
    ),
    FamilyReview(
        "test_layer_packed_cache.py",
        "Every peer passes the operations it has on both layers, the one "
        "past 2^32 elements included (its offset is in the views' data pointer, not in the kernels' "
        "index arithmetic).",
    ),
    FamilyReview(
        "test_tensor_parallel.py",
        "Every peer passes the ranks' calls it has (decode, prefill or "
        "write_kv), in every sharding and both pool layouts.",
    ),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedbench.conformance.peers.findings", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("results/conformance/findings.md"))
    args = parser.parse_args(argv)
    for module in (
        vllm_unified,
        vllm_paged_decode,
        vllm_prefill,
        vllm_cache_write,
        vllm_merge,
        sglang_decode,
        sglang_merge,
    ):
        module.load()  # the kernel files, so that the reproductions' import lines find them
    report_files.write_atomically(args.out, render(FINDINGS, REVIEWS))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
