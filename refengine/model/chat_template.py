"""A model folder's chat template, rendered into token ids: shared by the CLI's ``--chat`` and the server's
``/v1/chat/completions`` and ``/tokenize``, so neither imports the other."""

from __future__ import annotations

import json
from pathlib import Path

from pagedbench.refengine.errors import InvalidArgumentError

__all__ = ["ChatTemplateError", "chat_template", "render_chat"]


class ChatTemplateError(InvalidArgumentError):
    """A folder without a chat template, or messages its template refuses (``raise_exception``)."""


def chat_template(folder: str) -> tuple[str, dict]:
    """(template, tokenizer config) of a folder: ``chat_template.jinja`` (what recent ``transformers``
    saves, so what ``make model`` writes), else ``tokenizer_config.json``'s ``chat_template``."""
    config_path = Path(folder) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    jinja = Path(folder) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), config
    template = config.get("chat_template")
    if not isinstance(template, str):
        raise ChatTemplateError(f"{folder} has no chat template (neither {jinja.name} nor a chat_template "
                                f"in {config_path.name})")
    return template, config


def render_chat(folder: str, tokenizer, messages: list[dict]) -> dict:
    """``messages`` (``{"role", "content"}`` dicts) rendered with the folder's chat template and a
    generation prompt, as token ids; :class:`ChatTemplateError` when the template refuses them."""
    template, config = chat_template(folder)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ChatTemplateError(f"the chat template refused the prompt: {message}")

    def token(key: str) -> str:
        value = config.get(key) or ""
        return value.get("content", "") if isinstance(value, dict) else value

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    rendered = env.from_string(template).render(
        messages=messages, add_generation_prompt=True,
        bos_token=token("bos_token"), eos_token=token("eos_token"))
    return {"prompt_token_ids": tokenizer.encode(rendered, add_special_tokens=False).ids}
