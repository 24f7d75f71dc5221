"""The block object, the intrusive doubly linked list that holds the free cached ones, and the FIFO list
that holds the free uncached ones (:class:`FifoBlockQueue`, never taken from the middle).

A :class:`KVBlock` carries its own list links (``prev_free`` / ``next_free``), so a block found through
the prefix-cache map can be taken out of the middle of the free list in O(1) (vLLM v1 does the same;
nano-vllm's ``deque.remove`` is O(n)). Two sentinel nodes bound the list, so no operation branches on
an empty neighbour::

    head <-> b7 <-> b3 <-> b4 <-> tail
            (LRU: taken first)  (MRU: appended last)

:class:`FreeBlockQueue` invariants (checked by :meth:`FreeBlockQueue.check`):

* every block in the queue has ``ref_count == 0`` and ``in_free_queue`` set; no block is in it twice;
* ``len(queue)`` equals the number of blocks between the sentinels;
* links are consistent: ``b.next_free.prev_free is b`` for every node ``b`` (sentinels included);
* a block not in any queue has both links ``None``.

Eviction order: the head is the least recently freed block. The block manager frees a sequence's
blocks tail first, so a chain's tail sits nearer the head than its own head and is evicted first.
``popleft``, ``append`` and ``remove`` are O(1) and allocate nothing; ``popleft_many`` and ``extend`` are
their batches, one pass over the blocks.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical KV block's bookkeeping (the KV data itself lives in the block pool)."""

    block_id: int  # physical block id: index into the pool, fixed for the block's lifetime
    ref_count: int = 0  # number of block tables holding this block; 0 means it is in a free queue
    block_hash: bytes | None = None  # prefix-cache key while the block is published in the cache map
    parent_hash: bytes | None = None  # the chain hash this block's hash was computed from (for checks)
    token_ids: tuple[int, ...] | None = None  # tokens whose KV the block holds, kept to verify every hit
    parent_key: object = None  # content_id of the parent cached block, or ("root", salt) for a first block
    content_id: int = 0  # unique id of this publication (never reused), the parent_key of its children
    in_free_queue: bool = False  # True while linked into a FreeBlockQueue
    prev_free: KVBlock | None = field(default=None, repr=False)  # previous node in the free queue
    next_free: KVBlock | None = field(default=None, repr=False)  # next node in the free queue

    def clear_cache_entry(self) -> None:
        """Forget the prefix-cache identity (on eviction)."""
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = None
        self.parent_key = None
        self.content_id = 0


_IN_FREE_QUEUE = operator.attrgetter("in_free_queue")


class FreeBlockQueue:
    """An intrusive doubly linked list of free :class:`KVBlock` objects (see the module docstring)."""

    __slots__ = ("_head", "_tail", "length")

    def __init__(self, blocks: list[KVBlock] | None = None) -> None:
        self._head = KVBlock(-1)  # sentinel before the LRU block
        self._tail = KVBlock(-1)  # sentinel after the MRU block
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.length = 0  # len(queue), read-only: as an attribute for the block manager's every call
        for b in blocks or ():
            self.append(b)

    def __len__(self) -> int:
        return self.length

    def __bool__(self) -> bool:
        return self.length > 0

    def popleft(self) -> KVBlock:
        """Take the least recently appended block. Raises IndexError when empty."""
        b = self._head.next_free
        if b is self._tail:
            raise IndexError("popleft from an empty FreeBlockQueue")
        nxt = b.next_free
        self._head.next_free = nxt
        nxt.prev_free = self._head
        b.prev_free = b.next_free = None
        b.in_free_queue = False
        self.length -= 1
        return b

    def popleft_many(self, n: int) -> list[KVBlock]:
        """The ``n`` least recently appended blocks, in the order ``n`` calls of :meth:`popleft` take them,
        each with ``ref_count`` 1 (for a caller handing them to block tables at once: a batch of takes
        costs one pass, not two calls a block). Raises IndexError, taking none, when fewer are queued."""
        if n > self.length:
            raise IndexError(f"popleft_many({n}) from a FreeBlockQueue of {self.length}")
        out = []
        b = self._head.next_free
        for _ in range(n):
            out.append(b)
            nxt = b.next_free
            b.prev_free = b.next_free = None
            b.in_free_queue = False
            b.ref_count = 1
            b = nxt
        self._head.next_free = b
        b.prev_free = self._head
        self.length -= n
        return out

    def extend(self, blocks: list[KVBlock], *, release: bool = False) -> None:
        """:meth:`append` each of ``blocks`` in order (one pass); ``release``: each one's ``ref_count`` set
        to 0 as well (its last table let go of it). Raises AssertionError, appending none, when one of them
        is in a free queue already."""
        if any(map(_IN_FREE_QUEUE, blocks)):
            b = next(b for b in blocks if b.in_free_queue)
            raise AssertionError(f"block {b.block_id} appended to a free queue twice")
        last = self._tail.prev_free
        if release:
            for b in blocks:
                b.ref_count = 0
                last.next_free = b
                b.prev_free = last
                b.in_free_queue = True
                last = b
        else:
            for b in blocks:
                last.next_free = b
                b.prev_free = last
                b.in_free_queue = True
                last = b
        last.next_free = self._tail
        self._tail.prev_free = last
        self.length += len(blocks)

    def peekleft(self) -> KVBlock | None:
        """The block ``popleft`` would return, or None when empty."""
        b = self._head.next_free
        return None if b is self._tail else b

    def append(self, b: KVBlock) -> None:
        """Put ``b`` at the MRU end."""
        if b.in_free_queue:
            raise AssertionError(f"block {b.block_id} appended to a free queue twice")
        last = self._tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self._tail
        self._tail.prev_free = b
        b.in_free_queue = True
        self.length += 1

    def remove(self, b: KVBlock) -> None:
        """Unlink ``b`` from anywhere in the queue (O(1))."""
        if not b.in_free_queue:
            raise AssertionError(f"block {b.block_id} removed from a free queue it is not in")
        prv, nxt = b.prev_free, b.next_free
        prv.next_free = nxt
        nxt.prev_free = prv
        b.prev_free = b.next_free = None
        b.in_free_queue = False
        self.length -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        """LRU to MRU (the order ``popleft`` takes them)."""
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free

    def block_ids(self) -> list[int]:
        """Block ids from LRU to MRU."""
        return [b.block_id for b in self]

    def check(self, name: str) -> None:
        """Raise AssertionError naming the broken invariant (see the module docstring)."""
        seen: set[int] = set()
        node = self._head
        while node.next_free is not self._tail:
            nxt = node.next_free
            if nxt is None or nxt.prev_free is not node:
                raise AssertionError(f"{name}: broken links after block {node.block_id}")
            if nxt.block_id in seen:
                raise AssertionError(f"{name}: block {nxt.block_id} is in the queue twice")
            if nxt.ref_count != 0:
                raise AssertionError(f"{name}: block {nxt.block_id} is free with ref count {nxt.ref_count}")
            if not nxt.in_free_queue:
                raise AssertionError(f"{name}: block {nxt.block_id} is linked but not marked in_free_queue")
            seen.add(nxt.block_id)
            node = nxt
            if len(seen) > self.length:
                raise AssertionError(f"{name}: more linked blocks than its length {self.length}")
        if self._tail.prev_free is not node:
            raise AssertionError(f"{name}: tail sentinel does not point back at the last block")
        if len(seen) != self.length:
            raise AssertionError(f"{name}: length {self.length} but {len(seen)} blocks linked")


class FifoBlockQueue:
    """A FIFO of free :class:`KVBlock` objects that never leave from the middle (the uncached ones): a list
    read from a moving head, so that a batch of takes is one slice and a batch of frees one extend, at C
    speed (the intrusive list's O(1) ``remove`` is what only the cached queue needs). Same order and
    interface as :class:`FreeBlockQueue` less ``remove``; links stay ``None``."""

    __slots__ = ("_head", "_items", "length")

    _COMPACT = 1024  # the taken slots at the front dropped once this many and half the list

    def __init__(self, blocks: list[KVBlock] | None = None) -> None:
        self._items: list[KVBlock] = []
        self._head = 0  # items[:head] were taken
        self.length = 0
        if blocks:
            self.extend(list(blocks))

    def __len__(self) -> int:
        return self.length

    def __bool__(self) -> bool:
        return self.length > 0

    def popleft(self) -> KVBlock:
        """Take the least recently appended block. Raises IndexError when empty."""
        if not self.length:
            raise IndexError("popleft from an empty FifoBlockQueue")
        b = self._items[self._head]
        self._head += 1
        self.length -= 1
        b.in_free_queue = False
        self._compact()
        return b

    def popleft_many(self, n: int) -> list[KVBlock]:
        """As :meth:`FreeBlockQueue.popleft_many`."""
        if n > self.length:
            raise IndexError(f"popleft_many({n}) from a FifoBlockQueue of {self.length}")
        h = self._head
        out = self._items[h:h + n]
        self._head = h + n
        self.length -= n
        for b in out:
            b.in_free_queue = False
            b.ref_count = 1
        self._compact()
        return out

    def extend(self, blocks: list[KVBlock], *, release: bool = False) -> None:
        """As :meth:`FreeBlockQueue.extend`."""
        if any(map(_IN_FREE_QUEUE, blocks)):
            b = next(b for b in blocks if b.in_free_queue)
            raise AssertionError(f"block {b.block_id} appended to a free queue twice")
        if release:
            for b in blocks:
                b.ref_count = 0
                b.in_free_queue = True
        else:
            for b in blocks:
                b.in_free_queue = True
        self._items += blocks
        self.length += len(blocks)

    def append(self, b: KVBlock) -> None:
        """Put ``b`` at the MRU end."""
        self.extend([b])

    def peekleft(self) -> KVBlock | None:
        return self._items[self._head] if self.length else None

    def _compact(self) -> None:
        h = self._head
        if h >= self._COMPACT and 2 * h >= len(self._items):
            del self._items[:h]
            self._head = 0

    def __iter__(self) -> Iterator[KVBlock]:
        """LRU to MRU (the order ``popleft`` takes them)."""
        return iter(self._items[self._head:])

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]

    def check(self, name: str) -> None:
        """Raise AssertionError naming the broken invariant (see :class:`FreeBlockQueue`)."""
        live = self._items[self._head:]
        if len(live) != self.length:
            raise AssertionError(f"{name}: length {self.length} but {len(live)} blocks queued")
        seen: set[int] = set()
        for b in live:
            if b.block_id in seen:
                raise AssertionError(f"{name}: block {b.block_id} is in the queue twice")
            if b.ref_count != 0:
                raise AssertionError(f"{name}: block {b.block_id} is free with ref count {b.ref_count}")
            if not b.in_free_queue:
                raise AssertionError(f"{name}: block {b.block_id} is queued but not marked in_free_queue")
            if b.prev_free is not None or b.next_free is not None:
                raise AssertionError(f"{name}: block {b.block_id} is queued with links")
            seen.add(b.block_id)
