"""Arena placement allocators: exact buddy split/merge offsets, non-power-of-two arenas, first fit, and a
property test of both against a model (no overlap; everything merges back when all is freed)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pagedbench.refengine.errors import InvalidArgumentError
from pagedbench.refengine.kv.arena import BuddyAllocator, FirstFitAllocator, make_allocator


def state(a) -> tuple:
    return a.free_blocks(), a.num_free, a.rounding_waste, a.largest_free()


# --- buddy --------------------------------------------------------------------------------------
def test_buddy_splits_lowest_smallest_block_and_records_rounding():
    b = BuddyAllocator(16)
    assert b.allocate(3) == 0  # 16 -> 8 + 8 -> 4 + 4: takes [0, 4)
    assert b.free_blocks() == [(4, 4), (8, 8)]
    assert b.rounding_waste == 1 and b.num_free == 12
    assert b.allocate(1) == 4  # splits (4, 4) -> 4, 5, (6, 2)
    assert b.allocate(2) == 6
    assert b.allocate(5) == 8  # rounded to 8
    assert b.free_blocks() == [(5, 1)]
    assert b.rounding_waste == 1 + 3 and b.num_free == 1
    assert b.allocation(8) == (8, 5) and b.allocate(2) is None
    b.check_invariants()


def test_buddy_merges_only_buddies():
    b = BuddyAllocator(8)
    assert [b.allocate(2) for _ in range(3)] == [0, 2, 4]
    b.free(2)
    assert b.free_blocks() == [(2, 2), (6, 2)]  # 2's buddy 0 is live: no merge
    assert b.allocate(2) == 2  # of two free blocks of one order, the lowest goes first
    b.free(2)
    b.free(4)
    assert b.free_blocks() == [(2, 2), (4, 4)]  # 4 + 6 merge; 2 and 4 touch but are not buddies
    b.free(0)
    assert b.free_blocks() == [(0, 8)]
    b.check_invariants()


def test_buddy_non_power_of_two_arena_is_a_row_of_maximal_trees():
    b = BuddyAllocator(15_700)  # the vLLM paper's KV slots for OPT-13B on an A100-40GB
    assert b.trees == [(0, 13), (8192, 12), (12288, 11), (14336, 10), (15360, 8), (15616, 6), (15680, 4),
                       (15696, 2)]
    assert sum(1 << o for _, o in b.trees) == 15_700 and b.max_allocation == 8192
    assert b.allocate(8193) is None and b.num_free == 15_700  # bigger than any tree: never fits
    offsets = [b.allocate(2048) for _ in range(8)]  # Orca (Max): 2,048 slots each
    assert offsets == [12288, 8192, 10240, 0, 2048, 4096, 6144, None]  # the smallest tree that fits first
    assert b.num_free == 15_700 - 7 * 2048 and b.largest_free() == 1024
    for off in offsets[:-1]:
        b.free(off)
    assert b.free_blocks() == [(base, 1 << o) for base, o in b.trees]  # roots never merge across trees
    b.check_invariants()


def test_buddy_small_odd_arena():
    b = BuddyAllocator(13)  # 8 + 4 + 1
    assert b.allocate(1) == 12  # the 1-unit tree is the smallest block that fits
    assert b.allocate(1) == 8  # splits the 4-tree: 8 taken, 9 and (10, 2) free
    assert b.free_blocks() == [(0, 8), (9, 1), (10, 2)]
    b.free(12)
    b.free(8)
    assert b.free_blocks() == [(0, 8), (8, 4), (12, 1)]


# --- first fit ----------------------------------------------------------------------------------
def test_first_fit_exact_placement_and_external_fragmentation():
    f = FirstFitAllocator(10)
    assert [f.allocate(3) for _ in range(3)] == [0, 3, 6]
    f.free(3)
    assert f.free_blocks() == [(3, 3), (9, 1)]
    assert f.num_free == 4 and f.allocate(4) is None  # 4 free units, no hole of 4: external fragmentation
    assert not f.can_allocate(4) and f.can_allocate(3)
    assert f.allocate(1) == 3 and f.allocate(1) == 4  # first (lowest) hole that fits
    assert f.allocate(2) is None and f.allocate(1) == 5
    assert f.allocate(1) == 9 and f.free_blocks() == [] and f.largest_free() == 0
    assert f.rounding_waste == 0


def test_first_fit_coalesces_both_sides():
    f = FirstFitAllocator(12)
    offs = [f.allocate(3) for _ in range(4)]
    f.free(offs[0])
    f.free(offs[2])
    assert f.free_blocks() == [(0, 3), (6, 3)]
    f.free(offs[1])  # joins the hole below and the hole above
    assert f.free_blocks() == [(0, 9)]
    f.free(offs[3])
    assert f.free_blocks() == [(0, 12)]
    f.check_invariants()


# --- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["buddy", "first_fit"])
def test_bad_calls_raise_and_change_nothing(placement):
    a = make_allocator(placement, 16)
    off = a.allocate(3)
    a.allocate(2)
    before = state(a)
    for call, match in [
        (lambda: a.free(off + 1), "offset 1 is not the start of a live allocation"),
        (lambda: a.free(99), "offset 99 is not the start of a live allocation"),
        (lambda: a.allocate(0), "n must be >= 1, got 0"),
        (lambda: a.allocate(-2), "n must be >= 1, got -2"),
        (lambda: a.allocate(2.0), "n must be an int, got float"),
        (lambda: a.allocation(7), "offset 7 is not the start of a live allocation"),
    ]:
        with pytest.raises(InvalidArgumentError, match=match):
            call()
        assert state(a) == before
    a.free(off)
    with pytest.raises(InvalidArgumentError, match=r"double free or unknown offset"):
        a.free(off)
    a.check_invariants()


def test_bad_arena():
    for size in (0, -1):
        with pytest.raises(InvalidArgumentError, match=f"size must be >= 1, got {size}"):
            BuddyAllocator(size)
    with pytest.raises(InvalidArgumentError, match="placement must be 'buddy' or 'first_fit', got 'best'"):
        make_allocator("best", 8)


# --- property test against a model -------------------------------------------------------------
OPS = st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1_000)), max_size=60)


@given(placement=st.sampled_from(["buddy", "first_fit"]), size=st.sampled_from([1, 5, 16, 37, 100]), ops=OPS)
def test_random_alloc_free_against_a_model(placement, size, ops):
    a = make_allocator(placement, size)
    live: dict[int, tuple[int, int]] = {}  # offset -> (units held, requested)
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            need = a.footprint(n)
            fits = any(units >= need for _, units in a.free_blocks())
            off = a.allocate(n)
            assert (off is not None) == fits, f"allocate({n}) -> {off} but a free block fits: {fits}"
            if off is not None:
                held = need
                if placement == "buddy":  # a buddy block is aligned to its size inside its tree
                    base = max(b for b, _ in a.trees if b <= off)
                    assert (off - base) % held == 0, f"block {off} of {held} misaligned in tree at {base}"
                live[off] = (held, n)
        else:
            off = sorted(live)[pick % len(live)]
            a.free(off)
            del live[off]
        spans = sorted((off, held) for off, (held, _) in live.items())
        for (o1, u1), (o2, _) in itertools.pairwise(spans):
            assert o1 + u1 <= o2, "two live allocations overlap"
        assert all(o >= 0 and o + u <= size for o, u in spans)
        assert a.num_free == size - sum(u for _, u in spans)
        assert a.rounding_waste == sum(h - r for h, r in live.values())
        a.check_invariants()
    for off in list(live):
        a.free(off)
    whole = [(base, 1 << o) for base, o in a.trees] if placement == "buddy" else [(0, size)]
    assert a.free_blocks() == whole and a.num_free == size and a.rounding_waste == 0


@pytest.mark.parametrize("make", [BuddyAllocator, FirstFitAllocator], ids=["buddy", "first-fit"])
def test_check_invariants_names_a_gap_in_the_arena(make):
    a = make(64)
    a.allocate(8)
    offset = a.allocate(8)
    a.check_invariants()
    del a._live[offset]  # lose track of a live allocation: its span is neither free nor held
    with pytest.raises(AssertionError, match="gap or overlap"):
        a.check_invariants()
