"""One linear arena of KV slots with real placement allocators, for the contiguous (Orca) baselines.

An arena is ``size`` consecutive units (slots, or blocks of slots) numbered ``0 .. size-1``. A request
takes one *consecutive* run; when it leaves, its run becomes a hole. Holes that are too small for the
next request are external fragmentation, and it is real here: nothing moves once placed.

* :class:`BuddyAllocator` — the binary buddy system (Orca's baseline in the vLLM paper, §6.1). A request
  of ``n`` units gets a block of ``2**ceil(log2 n)`` units; the difference is *rounding waste*
  (:attr:`BuddyAllocator.rounding_waste`), reported as its own figure.
* :class:`FirstFitAllocator` — the lowest-addressed hole that fits, split exactly; neighbours coalesce
  on free.

Both answer ``allocate(n) -> offset | None`` (None: no hole fits, nothing changed) and ``free(offset)``
(an offset that is not the start of a live allocation — double free, unknown — raises
:class:`~refengine.errors.InvalidArgumentError` and changes nothing).
"""

from __future__ import annotations

import bisect
import itertools

from pagedbench.refengine.errors import InvalidArgumentError


def _units(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgumentError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    if n < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {n}")
    return n


class BuddyAllocator:
    """Binary buddy allocation over an arena of any size.

    Non-power-of-two arenas: the arena is decomposed into *maximal power-of-two buddy trees*, one per set
    bit of ``size``, laid out largest first (15,700 = 8192 + 4096 + 2048 + 1024 + 256 + 64 + 16 + 4,
    trees at offsets 0, 8192, 12288, ...). Splitting and merging stay inside a tree: a block's buddy is
    ``tree_base + ((offset - tree_base) ^ 2**order)``, and a tree's root never merges with its neighbour.
    So the largest allocation is the largest tree (``2**floor(log2 size)``), and a request bigger than
    that fails even when the total free space would hold it.

    Invariants: the free blocks and the live blocks tile the arena exactly (no overlap, no gap); no two
    free buddies of the same order coexist (they would have merged); among blocks of one order the
    lowest offset is handed out first, so placement is deterministic.
    """

    def __init__(self, size: int) -> None:
        self.size = _units("size", size)
        #: (base, order) of each buddy tree, by increasing base (= decreasing order)
        self.trees: list[tuple[int, int]] = []
        base = 0
        for order in range(self.size.bit_length() - 1, -1, -1):
            if self.size >> order & 1:
                self.trees.append((base, order))
                base += 1 << order
        self._tree_bases = [b for b, _ in self.trees]
        self._free: dict[int, set[int]] = {o: set() for o in range(self.size.bit_length())}
        for b, o in self.trees:
            self._free[o].add(b)
        self._live: dict[int, tuple[int, int]] = {}  # offset -> (order, requested units)
        self.num_free = self.size  # units in free blocks
        self.rounding_waste = 0  # sum over live allocations of 2**order - requested

    @staticmethod
    def order_for(n: int) -> int:
        """The buddy order that holds ``n`` units: ``ceil(log2 n)``."""
        return (n - 1).bit_length()

    def footprint(self, n: int) -> int:
        """Units an allocation of ``n`` takes (``n`` rounded up to a power of two)."""
        return 1 << self.order_for(_units("n", n))

    @property
    def max_allocation(self) -> int:
        """The largest ``n`` that can ever be placed: the largest tree."""
        return 1 << self.trees[0][1]

    def _smallest_free(self, order: int) -> int | None:
        for o in range(order, len(self._free)):
            if self._free[o]:
                return o
        return None

    def can_allocate(self, n: int) -> bool:
        """Whether :meth:`allocate` of ``n`` would succeed now."""
        return self._smallest_free(self.order_for(_units("n", n))) is not None

    def largest_free(self) -> int:
        """Units in the largest free block (0 when the arena is full)."""
        return max((1 << o for o, offs in self._free.items() if offs), default=0)

    def allocate(self, n: int) -> int | None:
        """Offset of a block of ``2**ceil(log2 n)`` units, or None when no free block is big enough."""
        order = self.order_for(_units("n", n))
        o = self._smallest_free(order)
        if o is None:
            return None
        offset = min(self._free[o])
        self._free[o].remove(offset)
        while o > order:  # split: keep the lower half, free the upper buddy
            o -= 1
            self._free[o].add(offset + (1 << o))
        self._live[offset] = (order, n)
        self.num_free -= 1 << order
        self.rounding_waste += (1 << order) - n
        return offset

    def free(self, offset: int) -> None:
        """Free the allocation starting at ``offset``, merging with free buddies inside its tree."""
        if offset not in self._live:
            raise InvalidArgumentError(
                f"offset {offset!r} is not the start of a live allocation (double free or unknown offset)")
        order, n = self._live.pop(offset)
        self.num_free += 1 << order
        self.rounding_waste -= (1 << order) - n
        base, tree_order = self.trees[bisect.bisect_right(self._tree_bases, offset) - 1]
        # The bound keeps merging inside the tree. (With maximal trees a root's would-be buddy is the
        # next tree's root, of a smaller order, so it could not be free at this order anyway.)
        while order < tree_order:
            buddy = base + ((offset - base) ^ (1 << order))
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)

    def allocation(self, offset: int) -> tuple[int, int]:
        """``(units held, units requested)`` of the live allocation at ``offset``."""
        if offset not in self._live:
            raise InvalidArgumentError(f"offset {offset!r} is not the start of a live allocation")
        order, n = self._live[offset]
        return 1 << order, n

    def free_blocks(self) -> list[tuple[int, int]]:
        """Free blocks as sorted ``(offset, units)``."""
        return sorted((off, 1 << o) for o, offs in self._free.items() for off in offs)

    def check_invariants(self) -> None:
        """Raise AssertionError if free and live blocks do not tile the arena, or two free buddies coexist."""
        spans = self.free_blocks() + [(off, 1 << o) for off, (o, _) in self._live.items()]
        _check_tiling("buddy arena", spans, self.size)
        if self.num_free != sum(u for _, u in self.free_blocks()):
            raise AssertionError("buddy arena: num_free drifted from the free lists")
        for (base, tree_order) in self.trees:
            for o in range(tree_order):
                for off in self._free[o]:
                    if base <= off < base + (1 << tree_order) and \
                            base + ((off - base) ^ (1 << o)) in self._free[o]:
                        raise AssertionError(f"buddy arena: free buddies at order {o} not merged ({off})")


class FirstFitAllocator:
    """First-fit placement: the lowest-addressed hole that holds ``n`` units, split exactly.

    Invariants: holes are sorted by offset, never touch (adjacent holes are coalesced on free), and
    together with the live allocations tile the arena exactly. No rounding: an allocation holds exactly
    the units it asked for.
    """

    def __init__(self, size: int) -> None:
        self.size = _units("size", size)
        self._hole_offsets: list[int] = [0]  # sorted
        self._hole_units: dict[int, int] = {0: self.size}
        self._live: dict[int, int] = {}  # offset -> units
        self.num_free = self.size
        self.rounding_waste = 0  # always 0: first fit places exactly what was asked

    def footprint(self, n: int) -> int:
        """Units an allocation of ``n`` takes (exactly ``n``)."""
        return _units("n", n)

    @property
    def max_allocation(self) -> int:
        return self.size

    def can_allocate(self, n: int) -> bool:
        n = _units("n", n)
        return any(self._hole_units[o] >= n for o in self._hole_offsets)

    def largest_free(self) -> int:
        return max(self._hole_units.values(), default=0)

    def allocate(self, n: int) -> int | None:
        """Offset of the first hole with at least ``n`` units (its low end), or None when none fits."""
        n = _units("n", n)
        for i, off in enumerate(self._hole_offsets):
            units = self._hole_units[off]
            if units >= n:
                del self._hole_units[off]
                if units == n:
                    del self._hole_offsets[i]
                else:
                    self._hole_offsets[i] = off + n
                    self._hole_units[off + n] = units - n
                self._live[off] = n
                self.num_free -= n
                return off
        return None

    def free(self, offset: int) -> None:
        """Free the allocation at ``offset``; the hole coalesces with the holes on either side."""
        if offset not in self._live:
            raise InvalidArgumentError(
                f"offset {offset!r} is not the start of a live allocation (double free or unknown offset)")
        units = self._live.pop(offset)
        self.num_free += units
        i = bisect.bisect_left(self._hole_offsets, offset)
        start, end = offset, offset + units
        if i < len(self._hole_offsets) and self._hole_offsets[i] == end:  # merge the hole above
            end += self._hole_units.pop(end)
            del self._hole_offsets[i]
        if i > 0:  # merge the hole below
            below = self._hole_offsets[i - 1]
            if below + self._hole_units[below] == start:
                self._hole_units[below] += end - start
                return
        self._hole_offsets.insert(i, start)
        self._hole_units[start] = end - start

    def allocation(self, offset: int) -> tuple[int, int]:
        """``(units held, units requested)`` of the live allocation at ``offset`` (equal for first fit)."""
        if offset not in self._live:
            raise InvalidArgumentError(f"offset {offset!r} is not the start of a live allocation")
        return self._live[offset], self._live[offset]

    def free_blocks(self) -> list[tuple[int, int]]:
        """Holes as sorted ``(offset, units)``."""
        return [(o, self._hole_units[o]) for o in self._hole_offsets]

    def check_invariants(self) -> None:
        """Raise AssertionError if holes and allocations do not tile the arena or two holes touch."""
        if self._hole_offsets != sorted(self._hole_units):
            raise AssertionError("first-fit arena: hole index out of sync")
        _check_tiling("first-fit arena", self.free_blocks() + list(self._live.items()), self.size)
        holes = self.free_blocks()
        for (a, ua), (b, _) in itertools.pairwise(holes):
            if a + ua == b:
                raise AssertionError(f"first-fit arena: holes at {a} and {b} touch (not coalesced)")
        if self.num_free != sum(u for _, u in holes):
            raise AssertionError("first-fit arena: num_free drifted from the holes")


def make_allocator(placement: str, size: int) -> BuddyAllocator | FirstFitAllocator:
    """``"buddy"`` -> :class:`BuddyAllocator`, ``"first_fit"`` -> :class:`FirstFitAllocator`."""
    if placement == "buddy":
        return BuddyAllocator(size)
    if placement == "first_fit":
        return FirstFitAllocator(size)
    raise InvalidArgumentError(f"placement must be 'buddy' or 'first_fit', got {placement!r}")


def _check_tiling(name: str, spans: list[tuple[int, int]], size: int) -> None:
    """Raise AssertionError unless the (offset, units) spans tile [0, size) without gap or overlap."""
    pos = 0
    for off, units in sorted(spans):
        if off != pos:
            raise AssertionError(f"{name}: gap or overlap at {pos} (next block at {off})")
        pos += units
    if pos != size:
        raise AssertionError(f"{name}: blocks cover {pos} units, arena has {size}")
