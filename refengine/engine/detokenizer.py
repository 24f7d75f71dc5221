"""Text of a token stream, a piece at a time, without decoding the whole output at every token.

Text-generation-inference's incremental scheme: decode a short window ``ids[prefix:]`` and emit what
it adds to the window's already-emitted part ``ids[prefix:read]``. A window that ends inside a
multi-byte character decodes to U+FFFD at its end; nothing is emitted until the character completes
(or the stream ends). Decoding the window with its left context keeps the spaces a tokenizer puts
at word starts, which decoding each token alone would drop.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """One completion's text. ``tokenizer`` is a ``tokenizers.Tokenizer`` (``decode(ids) -> str``)."""

    __slots__ = ("ids", "prefix", "read", "tokenizer")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # tokens whose text was emitted

    def add(self, token_ids, *, final: bool = False) -> str:
        """The text that ``token_ids`` (the next tokens) add; ``final``: flush what was held back."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read])
        after = decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""
