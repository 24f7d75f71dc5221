"""Errors raised by the reference engine. All derive from :class:`KVCacheError`.

A caller's mistake is a ``ValueError`` (or ``TypeError``) subclass naming what was expected and what
was given; running out of blocks is an expected condition that leaves every piece of state unchanged.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base of every error the KV cache, block manager and engine raise."""


class OutOfBlocksError(KVCacheError):
    """An allocation could not be satisfied. Nothing was taken; state is unchanged."""


class UnknownSequenceError(KVCacheError, KeyError):
    """A sequence id that is not allocated (never was, or was already freed)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown sequence"


class DuplicateSequenceError(KVCacheError, ValueError):
    """A sequence id that is already allocated."""


class InvalidArgumentError(KVCacheError, ValueError):
    """An argument out of range or of the wrong kind (negative id, empty prompt, bad size...)."""


class InvalidRequestError(KVCacheError, ValueError):
    """A request the engine cannot serve (empty prompt, token outside the vocabulary, too long...)."""


class InsufficientMemoryError(KVCacheError, MemoryError):
    """The KV pool asked for more memory than the device has available; nothing was allocated."""
