"""Incremental detokenization: the pieces add up to the whole text, a character split across tokens
is held back until it completes, and the stream's end flushes what is left."""

from __future__ import annotations

from pagedbench.refengine.server.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = one UTF-8 byte: the hardest case, every multi-byte character spans several tokens."""

    @staticmethod
    def decode(ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_split_character_is_held_until_complete():
    d = IncrementalDetokenizer(ByteTokenizer())
    e_acute = list("é".encode())
    assert d.add([ord("a")]) == "a"
    assert d.add(e_acute[:1]) == ""  # half a character: nothing yet
    assert d.add(e_acute[1:]) == "é"


def test_pieces_add_up_to_the_whole_text():
    text = "naïve café — 東京 ok"
    ids = list(text.encode())
    d = IncrementalDetokenizer(ByteTokenizer())
    pieces = [d.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)


def test_the_end_flushes_an_incomplete_character():
    d = IncrementalDetokenizer(ByteTokenizer())
    assert d.add([ord("x"), *list("東".encode())[:2]]) == ""  # the window ends mid-character: held whole
    assert d.add([], final=True) == "x\ufffd"
