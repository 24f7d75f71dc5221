"""The block manager's checks of its callers' token ids and sizes, each naming the problem it finds.

A prompt is checked whole on every :meth:`~pagedbench.refengine.kv.block_manager.BlockManager.allocate`
(a preempted sequence's prompt and output, often hundreds of tokens, each time it is admitted again),
so the common case, a list of plain ints, is read at C speed: through its marshal record when every id
is below 2**31 (one pass), else as int64 words.
"""

from __future__ import annotations

import marshal
import operator
import sys
from array import array
from collections.abc import Iterable

from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.kv import prefix_hash

MAX_TOKEN = prefix_hash.MAX_TOKEN_ID
_SIGN_BYTES = slice(7, None, 8) if sys.byteorder == "little" else slice(0, None, 8)  # of int64 words


def checked_positive_int(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    return value


def checked_token_id(token_id: object) -> int:
    if isinstance(token_id, bool):  # an int subclass, and never a token: a caller's mistake
        raise InvalidArgumentError(f"token id must be an int, got bool {token_id!r}")
    try:
        t = operator.index(token_id)
    except TypeError:
        raise InvalidArgumentError(f"token id must be an int, got {type(token_id).__name__}") from None
    if not 0 <= t < MAX_TOKEN:
        raise InvalidArgumentError(f"token id must be in [0, 2**63), got {t}")
    return t


def small_ints(tokens: list) -> bool:
    """Whether every item is an int itself in [0, 2**31), read from the list's marshal record (format 2,
    no back-references) in one pass at C speed: a 5-byte header (``[`` and the count), then one record
    per item starting with its type code. Only an int itself below 2**31 in magnitude is written as
    ``i`` and four little-endian bytes; a bool, a larger int, a float or another type is written
    otherwise (or refused). If the record is exactly 5 + 5 * n bytes long and every fifth byte from the
    fifth is ``i``, then by induction each record is such an int (the first starts at byte 5, and each
    ``i`` record is 5 bytes long, so the next starts where the next ``i`` is), and its fourth value
    byte below 0x80 says it is not negative."""
    try:
        record = marshal.dumps(tokens, 2)
    except ValueError:  # an item marshal cannot write (a numpy scalar): the general checks decide
        return False
    n = len(tokens)
    return len(record) == 5 + 5 * n and record[5::5].count(105) == n and record[9::5].isascii()


# the layout above, probed once (a Python whose marshal writes format 2 otherwise takes the general checks)
MARSHAL_CHECK = marshal.dumps([0, 1, 2**31 - 1], 2) == (
    b"[\x03\x00\x00\x00i\x00\x00\x00\x00i\x01\x00\x00\x00i\xff\xff\xff\x7f")


def checked_token_list(token_ids: Iterable[int]) -> list[int]:
    """The prompt as a new list of ints, validated at C speed: through its marshal record when every id is a
    plain int below 2**31 (:func:`small_ints`), else as int64 words, else item by item through ``array``."""
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    tokens = list(token_ids) if not isinstance(token_ids, list) else token_ids.copy()
    if tokens and MARSHAL_CHECK and small_ints(tokens):
        return tokens
    # otherwise in two passes at C speed: every item an int itself (no bool, no numpy scalar), and as an
    # int64 (an OverflowError past it) none negative (every word's sign byte an ASCII byte)
    if tokens and operator.countOf(map(type, tokens), int) == len(tokens):
        try:
            if array("q", tokens).tobytes()[_SIGN_BYTES].isascii():
                return tokens
        except OverflowError:
            pass  # the checks below name it
    types = set(map(type, tokens))  # at C speed
    if types == {int}:  # the common case, checked in two more passes (array's below make three)
        lo, hi = min(tokens), max(tokens)
        if lo < 0:
            raise InvalidArgumentError(f"token ids must be in [0, 2**63), got {lo}")
        if hi >= 1 << 63:
            raise InvalidArgumentError("token ids must be in [0, 2**63), got one >= 2**63")
        return tokens
    try:
        words = array("q", tokens)  # raises on a non-int or an id outside int64
    except TypeError:
        raise InvalidArgumentError("token_ids must be a sequence of ints") from None
    except OverflowError:
        raise InvalidArgumentError("token ids must be in [0, 2**63), got one >= 2**63") from None
    if not tokens:
        raise InvalidArgumentError("a prompt needs at least 1 token, got 0")
    if min(words) < 0:
        raise InvalidArgumentError(f"token ids must be in [0, 2**63), got {min(words)}")
    if bool in types:  # array("q") accepts bools, which are never tokens
        raise InvalidArgumentError("token ids must be ints, got a bool")
    if types != {int}:  # numpy or torch scalars: plain ints
        tokens = words.tolist()
    return tokens
