"""TokenSlotAllocator: slot 0 reserved, deterministic order, whole pages, double-free checks."""

from __future__ import annotations

import pytest

from engine.mem_cache.allocator import TokenSlotAllocator


def test_fresh_allocator_hands_out_1_to_size_in_order() -> None:
    a = TokenSlotAllocator(8)
    assert a.size == 8
    assert a.pool_size == 9
    assert a.available_size() == 8
    assert a.alloc(3) == [1, 2, 3]
    assert a.alloc(5) == [4, 5, 6, 7, 8]
    assert a.available_size() == 0
    assert a.alloc(1) is None
    assert a.alloc(0) == []
    a.check_integrity()


def test_alloc_returns_none_without_side_effects() -> None:
    a = TokenSlotAllocator(4)
    assert a.alloc(5) is None
    assert a.available_size() == 4
    assert a.alloc(4) == [1, 2, 3, 4]


def test_free_reuses_in_freed_order_and_is_deterministic() -> None:
    a = TokenSlotAllocator(6)
    slots = a.alloc(6)
    assert slots is not None
    a.free([5, 2])
    a.free([4])
    assert a.available_size() == 3
    assert a.alloc(3) == [4, 5, 2]  # last freed call first, in order within a call
    b = TokenSlotAllocator(6)
    b.alloc(6)
    b.free([5, 2])
    b.free([4])
    assert b.alloc(3) == [4, 5, 2]


def test_slot_zero_is_never_handed_out() -> None:
    a = TokenSlotAllocator(16)
    got = a.alloc(16)
    assert got is not None and 0 not in got
    assert sorted(got) == list(range(1, 17))
    assert not a.is_free(0)


@pytest.mark.parametrize("bad", [0, 9, -1, 100])
def test_free_out_of_range_raises_naming_slot(bad: int) -> None:
    a = TokenSlotAllocator(8)
    a.alloc(8)
    with pytest.raises(ValueError, match=rf"slot {bad}\b"):
        a.free([bad])


def test_double_free_raises_and_frees_nothing() -> None:
    a = TokenSlotAllocator(8)
    a.alloc(4)
    a.free([3])
    with pytest.raises(ValueError, match=r"slot 3 .*double free"):
        a.free([1, 3])
    # NOTE: the bad call must not have freed slot 1 either.
    assert a.available_size() == 5
    assert not a.is_free(1)
    with pytest.raises(ValueError, match=r"slot 2 .*twice"):
        a.free([2, 2])
    assert not a.is_free(2)
    a.check_integrity()


def test_free_unallocated_slot_raises() -> None:
    a = TokenSlotAllocator(8)
    with pytest.raises(ValueError, match="slot 5"):
        a.free([5])


def test_clear_restores_everything() -> None:
    a = TokenSlotAllocator(8)
    a.alloc(7)
    a.clear()
    assert a.available_size() == 8
    assert a.alloc(2) == [1, 2]
    a.check_integrity()


def test_bad_construction() -> None:
    with pytest.raises(ValueError):
        TokenSlotAllocator(10, page_size=4)
    with pytest.raises(ValueError):
        TokenSlotAllocator(8, page_size=0)


def test_pages_are_aligned_and_page_zero_reserved() -> None:
    a = TokenSlotAllocator(16, page_size=4)
    assert a.pool_size == 20
    assert a.available_size() == 16
    pages = a.alloc_pages(2)
    assert pages == [4, 8]
    assert a.available_size() == 8
    assert a.pages_to_slots(pages) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert a.alloc(8) == list(range(12, 20))
    assert a.alloc_pages(1) is None
    assert all(s // 4 > 0 for s in range(4, 20))
    a.check_integrity()


def test_paged_alloc_requires_whole_pages() -> None:
    a = TokenSlotAllocator(16, page_size=4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(3)
    with pytest.raises(ValueError):
        a.alloc_pages(-1)


def test_paged_free_releases_whole_pages_once() -> None:
    a = TokenSlotAllocator(16, page_size=4)
    pages = a.alloc_pages(4)
    assert pages == [4, 8, 12, 16]
    # A partly used last page: freeing its used slots releases the page.
    a.free([12, 13])
    assert a.available_size() == 4
    assert a.is_free(15)
    # All slots of two pages in one call: each page freed once.
    a.free(a.pages_to_slots([4, 16]))
    assert a.available_size() == 12
    with pytest.raises(ValueError, match="slot 14 .*double free"):
        a.free([14])
    with pytest.raises(ValueError, match="slot 3 "):
        a.free([3])
    with pytest.raises(ValueError, match="slot 20 "):
        a.free([20])
    assert a.alloc_pages(3) == [4, 16, 12]
    a.check_integrity()
