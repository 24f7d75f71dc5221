"""The study's batch: seeded prompts of random token ids (numpy only, so vLLM's venv can build it too)."""

from __future__ import annotations

import numpy as np


def make_prompts(num: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of random token ids, lengths uniform in ``min_len..max_len`` (both included)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"prompt lengths need 1 <= min_len <= max_len, got {min_len}..{max_len}")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, int(n)).tolist() for n in rng.integers(min_len, max_len + 1, num)]
