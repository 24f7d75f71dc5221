"""The findings of the layout family (``test_strided_layouts.py``) in the outside kernels: what they read
without a stride. Each reproduction calls the peer's kernel on a dense tensor and on a strided view of the
same values, against the float64 reference (``findings_page.attend``); listed in ``findings.FINDINGS``."""

from __future__ import annotations

from pagedbench.conformance.peers.findings_page import Finding, attend

PAGED_DECODE_FILE = "vllm/v1/attention/ops/chunked_prefill_paged_decode.py"
SGLANG_DECODE_FILE = "sglang/kernels/ops/attention/decode_attention.py"
CACHE_WRITE_FILE = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py"


def vllm_kernels_read_seq_lens_without_a_stride():
    import torch
    from vllm.v1.attention.ops.prefix_prefill import context_attention_fwd

    torch.manual_seed(0)
    heads, kv_heads, d, block_size, lens = 4, 2, 32, 16, [5, 3]  # two first prompts; sequence s in block s
    q = torch.randn(sum(lens), heads, d)
    k = torch.randn(2, block_size, kv_heads, d)  # [blocks, slots, kv_heads, d]
    v = torch.randn_like(k)
    x, scale, one = 16 // k.element_size(), d**-0.5, torch.ones(1)

    def prefill(seq_lens, block_table):
        out = torch.full_like(q, float("nan"))
        context_attention_fwd(
            q=q,
            k=None,
            v=None,
            o=out,
            kv_cache_dtype="auto",
            k_cache=k.view(2, block_size, kv_heads, d // x, x).permute(0, 2, 3, 1, 4),
            v_cache=v.permute(0, 2, 3, 1),
            b_loc=block_table,
            b_start_loc=torch.tensor([0, 5, 8], dtype=torch.int32),
            b_seq_len=seq_lens,
            max_seq_len=5,
            max_input_len=5,
            k_scale=one,
            v_scale=one,
            sm_scale=scale,
        )
        return out

    rows = [(s, i) for s, n in enumerate(lens) for i in range(n)]  # query i of sequence s sees keys 0..i
    want = torch.stack([attend(q[sum(lens[:s]) + i], k[s, : i + 1], v[s, : i + 1], scale) for s, i in rows])
    table, wide = torch.tensor([[0], [1]], dtype=torch.int32), torch.full((2, 3), -7, dtype=torch.int32)
    wide[:, 1:2] = table  # the same table as a column of a wider one (strides (3, 1))
    dense = torch.tensor(lens, dtype=torch.int32)
    every_other = dense.repeat_interleave(2)[::2]  # [5, 3] at stride 2 (the memory holds 5, 5, 3, 3)
    wrong = False
    for what, seq_lens, block_table in (
        ("dense b_seq_len and block table", dense, table),
        ("block table a column slice", dense, wide[:, 1:2]),
        ("b_seq_len at stride 2", every_other, table),
    ):
        err = (prefill(seq_lens, block_table).double() - want).abs().max().item()
        print(f"context_attention_fwd, {what}: max |error| = {err:.1e}")
        wrong = wrong or not err < 1e-3
    return wrong


def vllm_cache_write_reads_slots_and_token_dims_as_dense():
    import torch
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    torch.manual_seed(0)
    kv_heads, d, block_size, slots = 2, 8, 4, [5, 2, 6]
    k, v = torch.randn(3, kv_heads, d), torch.randn(3, kv_heads, d)  # 3 tokens: [tokens, kv_heads, d]

    def write(key, value, slot_mapping):
        k_cache, v_cache = torch.zeros(2, block_size, kv_heads, d), torch.zeros(2, block_size, kv_heads, d)
        triton_reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping, "auto", torch.ones(1), torch.ones(1))
        rows = k_cache.view(-1, kv_heads, d)
        written = rows.abs().flatten(1).amax(1).nonzero().flatten().tolist()
        return (rows[slots] - k).abs().max().item(), sorted(written)

    def every_other(t, fill):  # t's values at every other element of a buffer twice as long in its last dim
        buf = torch.full((*t.shape, 2), fill, dtype=t.dtype)
        buf[..., 0] = t
        return buf[..., 0]

    wrong = False
    for what, key, value, slot_mapping in (
        ("dense", k, v, torch.tensor(slots)),
        ("slot_mapping at stride 2", k, v, every_other(torch.tensor(slots), -1)),
        ("key and value at stride 2 in their last dim", every_other(k, float("nan")), every_other(v, 0.0),
         torch.tensor(slots)),
    ):  # fmt: skip
        err, written = write(key, value, slot_mapping)
        print(f"{what}: max |k_cache[slots] - k| = {err:.1e}, slots written {written} (want {sorted(slots)})")
        wrong = wrong or not err < 1e-6 or written != sorted(slots)
    return wrong


def sglang_decode_one_sequence(q, k, v, splits: int, scale: float):
    """SGLang's ``decode_attention_fwd`` over one sequence: ``q`` ``[1, heads, d]`` against the ``n`` tokens of
    ``k`` and ``v`` ``[n, kv_heads, d]`` in ``splits`` KV splits; the output, ``[1, heads, d]`` in q's dtype."""
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    n, (_, heads, d) = k.shape[0], q.shape
    out = torch.empty(1, heads, d, dtype=q.dtype)
    decode_attention_fwd(
        q,
        k,
        v,
        out,
        kv_indptr=torch.tensor([0, n], dtype=torch.int32),
        kv_indices=torch.arange(n),
        attn_logits=torch.empty(1, heads, splits, d),
        attn_lse=torch.empty(1, heads, splits),
        num_kv_splits=torch.full((1,), splits, dtype=torch.int32),
        max_kv_splits=splits,
        sm_scale=scale,
        k_scale=1.0,
        v_scale=1.0,
    )
    return out


def sglang_decode_reads_the_query_dims_as_dense():
    import torch

    torch.manual_seed(0)
    heads, kv_heads, d, n, splits, scale = 4, 2, 32, 5, 2, 32**-0.5
    q = torch.randn(1, heads, d)
    k, v = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)  # one sequence of n tokens

    def decode(query):
        out = sglang_decode_one_sequence(query, k, v, splits, scale)
        return (out[0].double() - attend(q[0], k, v, scale)).abs().max().item()

    wide = torch.full((1, heads, d, 2), float("nan"))
    wide[..., 0] = q  # the same query at every other element of its last dim (strides (256, 64, 2))
    errors = {"dense": decode(q), "last dim at stride 2": decode(wide[..., 0])}
    for what, err in errors.items():
        print(f"decode_attention_fwd, q {what}: max |error| = {err:.1e}")
    return not errors["last dim at stride 2"] < 1e-3


STRIDE_FINDINGS = (
    Finding(
        "vLLM's attention kernels read the sequence lengths without a stride: a strided view is misread, unchecked",
        "limitation",
        "vllm 0.34.0",
        "`context_attention_fwd` (prefix prefill) takes strides for the queries, the output, the caches and "
        "the block table, but loads `b_seq_len[s]` and `b_start_loc[s]` at `ptr + s`; `unified_attention` and "
        "`chunked_prefill_paged_decode` load `seq_lens` the same way. A length tensor that is a view at "
        "stride 2 (the layout family's `tables-column-slice` case slices the lengths too) is read at the wrong "
        "elements and gives wrong rows (NaN in the gate, where the cache's unused slots are NaN), while a block "
        "table that is a column slice of a wider one is read right. This is outside their contract rather than "
        "a bug: vLLM builds these as dense buffers, and no stride is taken for them, but nothing checks it. "
        'The vLLM adapters refuse such views ("not supported"), so the matrix shows no failure for them; '
        "`unified_attention` and `chunked_prefill_paged_decode` give wrong rows the same way on block-16 "
        "variants of those cases (the family's cases use blocks of 8, which their backends refuse).",
        vllm_kernels_read_seq_lens_without_a_stride,
        (
            ("vllm/v1/attention/ops/prefix_prefill.py", "cur_batch_seq_len = tl.load(B_Seqlen + cur_batch)"),
            ("vllm/v1/attention/ops/prefix_prefill.py", "processed_b_loc.stride(0),"),
            ("vllm/v1/attention/ops/triton_unified_attention.py", "seq_len = tl.load(seq_lens_ptr + seq_idx)"),
            (PAGED_DECODE_FILE, "seq_len = tl.load(seq_lens_ptr + seq_idx)"),
        ),
        families=("test_strided_layouts.py",),
    ),
    Finding(
        "vLLM `triton_reshape_and_cache_flash`: the slot mapping and each token's heads x dims are read as dense "
        "runs, unchecked",
        "limitation",
        "vllm 0.34.0",
        "The cache write takes one stride per token row of `key` / `value` (`key.stride()[0]`) and loads the "
        "row's `num_heads * head_size` elements as one run (`+ tile_pos`), and loads `slot_mapping[t]` at "
        "`ptr + t`. A slot mapping at stride 2 sends tokens to the slots of its neighbours (or skips them), and "
        "keys or values at stride 2 in their last dim are stored interleaved with whatever lies between; a "
        "token row that is a slice of a fused QKV projection (a wider row, dense inside) is written right. "
        "Outside its contract (vLLM's keys come from a QKV split, its slot mapping from a dense buffer), but "
        "nothing checks it: the layout family's `tokens-dim-stride-2` and `slots-every-other` cases wrote the "
        'wrong slots. The `vllm-cache-write` adapter refuses such views ("not supported").',
        vllm_cache_write_reads_slots_and_token_dims_as_dense,
        (
            (CACHE_WRITE_FILE, "slot_idx = tl.load(slot_mapping_ptr + token_idx).to(tl.int64)"),
            (CACHE_WRITE_FILE, "key_stride = key.stride()[0]"),
            (CACHE_WRITE_FILE, "key_ptr + src_key_idx + tile_pos, mask=tile_pos < (num_heads * head_size)"),
        ),
        families=("test_strided_layouts.py",),
    ),
    Finding(
        "SGLang `decode_attention_fwd`: the query's last dim is read as one run, unchecked",
        "limitation",
        "sglang 0.5.23",
        "The decode kernels take token and head strides for `q` and the output (`q.stride(0)`, `q.stride(1)`) "
        "and address the head dim as `+ offs_d`, so a query at stride 2 in its last dim is read interleaved "
        "with what lies between its elements (NaN in the gate's `q-dim-stride-2` case); queries with their "
        "heads outermost, or slices of a fused QKV projection, are read right. Outside its contract (SGLang's "
        "queries are dense in their last dim), unchecked. vLLM's attention kernels address the query and "
        'output dims the same way. The `sglang-decode` and vLLM attention adapters refuse such views ("not '
        'supported").',
        sglang_decode_reads_the_query_dims_as_dense,
        (
            (SGLANG_DECODE_FILE, "off_q = cur_batch * stride_qbs + cur_head * stride_qh + offs_d"),
            (SGLANG_DECODE_FILE, "offs_q = cur_batch * stride_qbs + cur_head[:, None] * stride_qh + offs_d[None, :]"),
            (SGLANG_DECODE_FILE, "O + cur_batch * stride_obs + cur_head * stride_oh + offs_d,"),
        ),
        families=("test_strided_layouts.py",),
    ),
)
