"""The whole test suite NaN-poisons every LLM's KV pool, so a read of a slot nobody wrote shows up as NaN
logits and wrong tokens (outside tests the pool is left as the OS zeroed it: no fill on construction)."""

import os

os.environ.setdefault("PAGEDBENCH_POISON_KV", "1")
