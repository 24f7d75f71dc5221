"""Equal to Hugging Face: our paged Llama/Qwen2 forward against ``transformers``' own model.

Each case builds a small random ``transformers`` model (weights re-drawn with a spread so greedy tokens
are not decided by rounding), saves it with ``save_pretrained`` to a temporary folder, loads it with
:func:`refengine.load_model`, and runs a batch of prompts of different lengths through a test-local
driver: a NaN-poisoned :class:`BlockPool`, block tables drawn by hand from a random permutation of all
blocks (block 0 and the last included), every prompt prefilled in one flattened step, then greedy decode
steps. Logits at every position must agree with ``model(input_ids).logits`` within the dtype's bound,
and the greedy tokens must equal ``generate(do_sample=False)``.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedbench.refengine import load_model  # noqa: E402
from pagedbench.refengine.kv.block_pool import BlockPool  # noqa: E402
from pagedbench.refengine.model.attention_backend import AttentionMetadata  # noqa: E402

#: logits bound for float32: |ours - HF| <= ATOL + RTOL * |HF| (both sides compute in float32). Observed
#: (both backends, every case here, logits up to |4.2|): max 1.97e-6 (torch-batched, llama-rope-linear);
#: 1.1e-6 to 1.8e-6 elsewhere, 1.2e-6 Triton vs torch. The bound is 5x the worst observed.
FP32_ATOL, FP32_RTOL = 1e-5, 0.0
#: bfloat16 / float16: our max error against float32 logits (of the same rounded weights) may be at most this
#: multiple of HF's own half-precision model's error against them (observed, both backends: ratios
#: 0.82-1.26 for bf16, 0.67-1.17 for fp16) ...
HALF_ERROR_RATIO = 2.0
#: ... and at most this absolute error (observed max: bf16 3.64e-2, fp16 3.83e-3; bound 4x)
HALF_MAX_ABS = {torch.bfloat16: 0.15, torch.float16: 0.015}
BACKENDS = ["torch", "torch-batched"]  # the per-sequence reference and the batched CPU default

PROMPT_LENS = (1, 4, 5, 6, 13)  # N-1 / N / N+1 around block_size 5, a single token, several blocks
NUM_DECODE_STEPS = 4


# --- building Hugging Face checkpoints ---------------------------------------------------------------
def _spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight: embeddings N(0,1), linears N(0, 1/fan_in), biases and norms around 0 / 1.

    Tied embeddings are drawn 10x smaller: with the embedding as the LM head, a residual stream dominated
    by the input token's own embedding makes greedy decoding repeat that token forever (a weak test)."""
    gen = torch.Generator().manual_seed(seed)
    embed_std = 0.1 if model.config.tie_word_embeddings else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


HF_CASES = {
    # GQA 2:1, untied, no biases (the Llama control case); saved in shards with an index
    "llama-gqa2": (
        "LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2), {"max_shard_size": "60KB"}
    ),
    # Qwen2: q/k/v biases (o_proj without), GQA 4:1
    "qwen2-bias-gqa4": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1), {}),
    # Llama with tied embeddings (no lm_head tensor saved), attention_bias (q/k/v and o), MHA, rope_theta
    "llama-tied-bias": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
             rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
        {},
    ),
}
#: rotary scalings, head_dim 16: with original_max_position_embeddings=16 the llama3 bands (wavelength
#: < 4, 4..16, > 16 positions) each hold some of the 8 frequencies
ROPE_CASES = {
    "llama-rope-llama3": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), {}),
    "llama-rope-linear": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}), {}),
}
HF_CASES.update(ROPE_CASES)
MAIN_CASES = ["llama-gqa2", "qwen2-bias-gqa4", "llama-tied-bias"]


def build_hf_model(case: str, seed: int = 0):
    config_cls, extra, _ = HF_CASES[case]
    config = getattr(transformers, config_cls)(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))(config).eval()
    _spread_weights(model, seed)
    return model


@pytest.fixture(scope="module")
def hf_checkpoint(request, tmp_path_factory):
    """(HF model in float32, folder it was saved to) for one case of HF_CASES."""
    case = request.param
    model = build_hf_model(case)
    folder = tmp_path_factory.mktemp(case)
    model.save_pretrained(folder, **HF_CASES[case][2])
    return model, folder


# --- the test-local paged driver -----------------------------------------------------------------------
class PagedDriver:
    """Runs sequences through ``LlamaModel.forward`` over a BlockPool, with hand-built shuffled block tables.

    ``step({seq: new_token_ids})`` writes those tokens (each sequence's next ones) in one flattened step and
    returns each sequence's logits rows, float32 [len(new_token_ids), vocab].
    """

    def __init__(self, loaded, *, block_size: int, max_len: int, num_seqs: int, seed: int = 0) -> None:
        cfg = loaded.config
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = blocks_per_seq * num_seqs + 3  # a few never used: they stay NaN
        self.model, self.block_size = loaded.model, block_size
        self.pool = BlockPool(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size,
                              loaded.model.dtype, num_blocks=num_blocks)
        # block tables: a shuffled draw of the blocks that always includes block 0 and the last block
        # (the edges a stray offset hits); the blocks left over are never written and stay NaN
        gen = torch.Generator().manual_seed(seed)
        rest = (torch.randperm(num_blocks - 2, generator=gen) + 1).tolist()
        used = [0, num_blocks - 1, *rest[: blocks_per_seq * num_seqs - 2]]
        used = [used[i] for i in torch.randperm(len(used), generator=gen).tolist()]
        self.tables = [used[s * blocks_per_seq:(s + 1) * blocks_per_seq] for s in range(num_seqs)]
        self.lens = [0] * num_seqs

    def _slot(self, seq: int, pos: int) -> int:
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        seqs = sorted(chunks)
        ids, positions, slots = [], [], []
        for s in seqs:
            start = self.lens[s]
            ids += chunks[s]
            positions += range(start, start + len(chunks[s]))
            slots += [self._slot(s, p) for p in range(start, start + len(chunks[s]))]
            self.lens[s] += len(chunks[s])
        nblocks = [-(-self.lens[s] // self.block_size) for s in seqs]
        meta = AttentionMetadata.build(
            slot_mapping=slots, block_tables=[self.tables[s][:n] for s, n in zip(seqs, nblocks)],
            seq_lens=[self.lens[s] for s in seqs], query_lens=[len(chunks[s]) for s in seqs],
            device=self.model.device,
        )
        dev = self.model.device
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                            self.pool.kv_caches())
        logits = self.model.compute_logits(hidden).cpu()
        cu = meta.cu_seqlens_q.tolist()
        return {s: logits[cu[i]:cu[i + 1]] for i, s in enumerate(seqs)}


def run_greedy(loaded, prompts, *, block_size: int, steps: int):
    """Prefill all prompts in one step, then ``steps`` greedy decode steps.

    Returns (tokens per prompt: the steps + 1 generated ids, logits per prompt [len + steps, vocab])."""
    driver = PagedDriver(loaded, block_size=block_size, max_len=max(map(len, prompts)) + steps,
                         num_seqs=len(prompts))
    out = driver.step(dict(enumerate(prompts)))
    logits = {s: [out[s]] for s in out}
    tokens = {s: [int(out[s][-1].argmax())] for s in out}
    for _ in range(steps):
        out = driver.step({s: [tokens[s][-1]] for s in tokens})
        for s in out:
            logits[s].append(out[s])
            tokens[s].append(int(out[s][-1].argmax()))
    return [tokens[s] for s in sorted(tokens)], [torch.cat(logits[s]) for s in sorted(logits)]


def make_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def hf_greedy(hf_model, prompt: list[int], num_new: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                                min_new_tokens=num_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != HF {tuple(ref.shape)}"
    assert torch.isfinite(ours).all(), f"{what}: non-finite logits"
    err = (ours - ref).abs()
    bound = FP32_ATOL + FP32_RTOL * ref.abs()
    worst = int((err - bound).flatten().argmax())
    assert (err <= bound).all(), (
        f"{what}: max |ours - HF| = {err.max():.3e} (bound {FP32_ATOL} + {FP32_RTOL}*|HF|), "
        f"worst at row {worst // ref.shape[1]}"
    )


# --- the tests -----------------------------------------------------------------------------------------
def check_fp32_equal_hf(hf_model, folder, block_size: int, prompts, backend: str) -> None:
    loaded = load_model(folder, attention_backend=backend)
    assert loaded.model.dtype == torch.float32
    tokens, logits = run_greedy(loaded, prompts, block_size=block_size, steps=NUM_DECODE_STEPS)
    for i, prompt in enumerate(prompts):
        fed = prompt + tokens[i][:-1]  # what the driver fed: the prompt, then each generated token
        assert_logits_close(logits[i], hf_logits(hf_model, fed), f"prompt {i} (len {len(prompt)})")
        assert tokens[i] == hf_greedy(hf_model, prompt, NUM_DECODE_STEPS + 1), f"prompt {i} greedy tokens"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hf_checkpoint", MAIN_CASES, indirect=True)
@pytest.mark.parametrize("block_size", [5, 16])
def test_fp32_logits_and_greedy_tokens_equal_hf(hf_checkpoint, block_size, backend):
    hf_model, folder = hf_checkpoint
    check_fp32_equal_hf(hf_model, folder, block_size, make_prompts(hf_model.config.vocab_size), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hf_checkpoint", list(ROPE_CASES), indirect=True)
def test_rope_scaling_equal_hf(hf_checkpoint, backend):
    """Scaled rotary embeddings (Llama 3.1's llama3 bands, linear interpolation) out to position 40."""
    hf_model, folder = hf_checkpoint
    assert load_model(folder).config.rope_scaling is not None
    check_fp32_equal_hf(hf_model, folder, 5, make_prompts(hf_model.config.vocab_size, lens=(2, 9, 36)),
                        backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hf_checkpoint", ["llama-gqa2"], indirect=True)
def test_chunked_steps_mixing_prefill_and_decode_equal_hf(hf_checkpoint, backend):
    """Prompts fed in chunks (1-3 tokens and a long one) while others decode in the same step: the queries of
    a chunk are the last tokens of the cached sequence, and their logits still equal HF's."""
    hf_model, folder = hf_checkpoint
    loaded = load_model(folder, attention_backend=backend)
    seqs = make_prompts(hf_model.config.vocab_size, lens=(11, 9, 7), seed=5)
    schedule = [{0: 3, 1: 1}, {0: 1, 1: 7, 2: 2}, {0: 6, 1: 1, 2: 1}, {0: 1, 2: 4}]
    driver = PagedDriver(loaded, block_size=4, max_len=11, num_seqs=3, seed=3)
    fed = {s: 0 for s in range(3)}
    rows = {s: [] for s in range(3)}
    for step in schedule:
        out = driver.step({s: seqs[s][fed[s]:fed[s] + n] for s, n in step.items()})
        for s, n in step.items():
            fed[s] += n
            rows[s].append(out[s])
    assert fed == {s: len(seqs[s]) for s in range(3)}, "schedule must cover every token"
    for s in range(3):
        assert_logits_close(torch.cat(rows[s]), hf_logits(hf_model, seqs[s]), f"sequence {s}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hf_checkpoint", ["llama-gqa2", "qwen2-bias-gqa4"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_logits_within_the_dtypes_bound(hf_checkpoint, dtype, tmp_path, backend):
    """bf16 / fp16: ours is no further from float32 logits than twice HF's own half-precision model is,
    and within the dtype's absolute bound."""
    hf_model, folder = hf_checkpoint
    hf_half = type(hf_model).from_pretrained(folder, dtype=dtype).eval()
    hf_half.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, attention_backend=backend)  # dtype=None: the checkpoint's
    assert loaded.model.dtype == dtype and loaded.config.dtype == dtype
    prompts = make_prompts(hf_model.config.vocab_size)
    _, logits = run_greedy(loaded, prompts, block_size=5, steps=2)
    ref32 = type(hf_model).from_pretrained(tmp_path, dtype=torch.float32).eval()  # rounded weights, fp32 math
    for i, prompt in enumerate(prompts):
        fed = prompt + logits[i][len(prompt) - 1:-1].argmax(-1).tolist()
        truth = hf_logits(ref32, fed)
        ours_err = (logits[i] - truth).abs().max().item()
        hf_err = (hf_logits(hf_half, fed) - truth).abs().max().item()
        assert math.isfinite(ours_err) and ours_err <= HALF_ERROR_RATIO * hf_err, (
            f"prompt {i}: {dtype} max error {ours_err:.3e} > {HALF_ERROR_RATIO} x HF's {hf_err:.3e}"
        )
        assert ours_err <= HALF_MAX_ABS[dtype], f"prompt {i}: {dtype} max error {ours_err:.3e}"


def _triton_available() -> bool:
    from pagedbench import kernels

    return all(hasattr(kernels, op) for op in ("write_kv", "paged_decode", "paged_prefill"))


@pytest.mark.parametrize("hf_checkpoint", ["llama-gqa2"], indirect=True)
def test_triton_and_torch_backends_give_the_same_tokens(hf_checkpoint):
    """The Triton launchers (under the interpreter on a CPU) against the torch reference: same greedy tokens
    and logits within float32 bounds. Tiny: two short prompts, two decode steps (the interpreter is slow)."""
    if not _triton_available():
        pytest.skip("not supported: the Triton launchers are not in `kernels` yet")
    _, folder = hf_checkpoint
    prompts = make_prompts(256, lens=(3, 6), seed=7)
    results = {}
    for name in ("torch", "triton"):
        results[name] = run_greedy(load_model(folder, attention_backend=name), prompts, block_size=4, steps=2)
    assert results["triton"][0] == results["torch"][0]
    for i in range(len(prompts)):
        assert_logits_close(results["triton"][1][i], results["torch"][1][i], f"triton vs torch, prompt {i}")
