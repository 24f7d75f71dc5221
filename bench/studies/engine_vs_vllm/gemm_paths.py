"""The model's linear layers two ways on this CPU, side by side: torch's ``F.linear`` (the engine's path:
MKL's sgemm in torch's CPU wheels) and oneDNN with the weight prepacked once
(``torch.ops.mkldnn._linear_pointwise`` on ``_reorder_linear_weight``'s layout — the kind of path vLLM's
CPU build takes with its ``_C::onednn_mm``). Each shape at each token count, the two interleaved, best of
``rounds``; the ratio says how much of the profile's GEMM gap a prepacked path would recover here.
"""

from __future__ import annotations

from pagedbench.refengine.model.prepacked_linear import seconds_per_call


def linear_shapes(config: dict) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one decoder layer's linears (fused as the engine runs them) and
    the LM head, from a Hugging Face ``config.json``'s fields."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    d = config.get("head_dim", h // heads)
    return [("qkv", (heads + 2 * kv_heads) * d, h), ("o", h, heads * d), ("gate_up", 2 * inter, h),
            ("down", h, inter), ("lm_head", config["vocab_size"], h)]


def compare(config: dict, token_counts: tuple[int, ...] = (32, 512), rounds: int = 5, reps: int = 3,
            seed: int = 0) -> list[dict]:
    import torch

    if not torch.backends.mkldnn.is_available():
        return [{"status": "not run", "reason": "this torch has no oneDNN (mkldnn)"}]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for name, out_f, in_f in linear_shapes(config):
        w = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        for tokens in token_counts:
            x = torch.randn(tokens, in_f, generator=gen)
            paths = {"F.linear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                     "oneDNN prepacked": lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(
                         x, p, None, "none", [], "")}
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(rounds):
                for path, fn in paths.items():  # interleaved: a burst of load hits both alike
                    best[path] = min(best[path], seconds_per_call(fn, reps))
            ref = x.double() @ w.double().T
            err = {p: ((fn().double() - ref).abs().max() / ref.abs().max()).item() for p, fn in paths.items()}
            rows.append({"status": "ok", "layer": name, "out_features": out_f, "in_features": in_f,
                         "tokens": tokens, "seconds": best, "max_rel_error_vs_float64": err,
                         "ratio": best["F.linear"] / best["oneDNN prepacked"]})
    return rows
