"""The forms a prompt takes at the engine's door: token ids, a string, or a dict as vLLM takes it.

Shared by every front that queues requests (``LLM.generate``, beam search), so none of them imports
another's module for it.
"""

from __future__ import annotations

from collections.abc import Mapping

PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def unpack_prompt(prompt) -> tuple[object, str | None, str | None]:
    """``(prompt, cache_salt, error)`` from a prompt: token ids, a string, or a dict as vLLM takes it,
    ``{"prompt_token_ids": [...]}`` or ``{"prompt": "text"}``, with an optional ``"cache_salt"``."""
    if not isinstance(prompt, Mapping):
        return prompt, None, None
    unknown = sorted(set(prompt) - PROMPT_KEYS, key=str)
    if unknown:
        return None, None, f"unknown prompt keys {unknown}; expected {sorted(PROMPT_KEYS)}"
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        return None, None, "a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'"
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        return None, None, f"cache_salt must be a non-empty string, got {salt!r}"
    body = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if "prompt" in prompt and not isinstance(body, str):
        return None, None, f"'prompt' must be a string, got {type(body).__name__}"
    return body, salt, None
