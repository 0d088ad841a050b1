"""Token slot allocator: which KV-pool rows are free (no torch, plain ints).

A *slot* is one row of the token-to-KV pool (one token's K/V, or one MLA latent, per layer). The
allocator only hands out and takes back slot ids; the model runner owns the tensors they index.

Layout (page_size == p):

* The KV pool must hold ``pool_size == size + p`` rows. Page 0 (slots ``0 .. p-1``) is reserved:
  slot 0 is the padding sink that graph-captured batches write their dummy tokens to, and is never
  handed out. For ``p == 1`` the usable slots are exactly ``1 .. size``.
* Usable pages are ``1 .. size // p``; page ``k`` holds the ``p`` consecutive slots
  ``k*p .. k*p + p - 1``, so ``slot // p`` is the page index a paged attention kernel needs.

Ownership: a slot (page) is always owned by exactly one of the allocator (free), the radix cache, or
one running request. Whoever owns it frees it exactly once; a second free raises ``ValueError``.

How callers use ``page_size > 1``: a request owns whole pages. Token ``i`` of the request lives in
slot ``pages[i // p] + i % p`` where ``pages`` are first-slot ids from ``alloc_pages`` (or from the
radix cache's page-aligned prefix). Before writing token ``i`` with ``i % p == 0`` the caller
allocates one more page; otherwise it uses the next slot of its last page. ``alloc(n)`` is the
same thing for ``n`` a multiple of ``p``, returned already expanded to slot ids. ``free`` takes
slot ids and releases every page that contains one of them, so freeing the used part of a partly
filled last page releases the whole page.
"""

from __future__ import annotations

from collections.abc import Sequence


class TokenSlotAllocator:
    """Free list of KV-pool slots, allocated one slot (page_size 1) or one page at a time.

    alloc/free cost O(number of slots handled). Allocation order is deterministic: a fresh
    allocator hands out pages in increasing order; freed pages are reused last-freed-first.
    """

    def __init__(self, size: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < 0 or size % page_size != 0:
            raise ValueError(
                f"size must be a non-negative multiple of page_size={page_size}, got {size}"
            )
        self._size = size
        self.page_size = page_size
        self._num_pages = size // page_size
        # NOTE: _free_pages is a stack of page indices (pop from the end); _is_free[page] mirrors
        # membership so double frees are caught in O(1). Index 0 (the padding page) is never free.
        self._free_pages: list[int] = []
        self._is_free = bytearray(self._num_pages + 1)
        self.clear()

    @property
    def size(self) -> int:
        """Number of usable slots (excluding the reserved padding page)."""
        return self._size

    @property
    def pool_size(self) -> int:
        """Rows the KV pool must allocate: the usable slots plus the reserved page 0."""
        return self._size + self.page_size

    def available_size(self) -> int:
        """Number of free slots (always a multiple of page_size)."""
        return len(self._free_pages) * self.page_size

    def clear(self) -> None:
        """Mark every usable slot free. Callers must drop every slot id they still hold."""
        self._free_pages = list(range(self._num_pages, 0, -1))
        self._is_free = bytearray(b"\x01" * (self._num_pages + 1))
        self._is_free[0] = 0

    def is_free(self, slot: int) -> bool:
        """Whether the page holding ``slot`` is free (False for the reserved page)."""
        page = slot // self.page_size
        return 0 < page <= self._num_pages and bool(self._is_free[page])

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` pages; return their first slot ids, or None if too few are free.

        The caller owns the returned pages (all ``page_size`` slots of each) until it frees them
        or hands them to the radix cache.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_pages > len(self._free_pages):
            return None
        if num_pages == 0:
            return []
        pages = self._free_pages[-num_pages:]
        del self._free_pages[-num_pages:]
        pages.reverse()
        is_free = self._is_free
        p = self.page_size
        for page in pages:
            is_free[page] = 0
        return [page * p for page in pages]

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` slots; return their ids, or None if too few are free.

        With page_size > 1, ``n`` must be a multiple of page_size (whole pages, expanded to
        consecutive slot ids per page). The caller owns the returned slots.
        """
        p = self.page_size
        if n % p != 0:
            raise ValueError(f"alloc({n}): n must be a multiple of page_size={p}; use alloc_pages")
        firsts = self.alloc_pages(n // p)
        if firsts is None or p == 1:
            return firsts
        return self.pages_to_slots(firsts)

    def pages_to_slots(self, first_slots: Sequence[int]) -> list[int]:
        """Expand page first-slot ids into every slot id of those pages, in order."""
        p = self.page_size
        return [s + i for s in first_slots for i in range(p)]

    def free(self, slots: Sequence[int]) -> None:
        """Give slots back. With page_size > 1, frees each page containing one of ``slots`` once.

        Raises ValueError naming the slot on slot ids of the reserved page, out of range, or
        already free. NOTE: validation runs before anything is freed, so a bad call frees nothing.
        """
        if not slots:
            return
        p = self.page_size
        is_free = self._is_free
        num_pages = self._num_pages
        pages: list[int] = []
        seen: set[int] = set()
        for slot in slots:
            page = slot // p
            if page in seen:
                if p == 1:
                    raise ValueError(f"free: slot {slot} is given twice (double free)")
                continue  # another slot of a page already being freed
            if slot < p or page > num_pages:
                raise ValueError(
                    f"free: slot {slot} is out of the usable range [{p}, {self._size + p - 1}]"
                )
            if is_free[page]:
                raise ValueError(f"free: slot {slot} is already free (double free)")
            seen.add(page)
            pages.append(page)
        for page in pages:
            is_free[page] = 1
        # NOTE: pushed in reverse so the pages come back out in the order they were freed.
        self._free_pages.extend(reversed(pages))

    def check_integrity(self) -> None:
        """Assert the free stack and the free flags agree (O(size); for tests and debug mode)."""
        stack = self._free_pages
        assert len(set(stack)) == len(stack), (
            f"allocator: free list has {len(stack) - len(set(stack))} duplicate pages"
        )
        flagged = sum(self._is_free)
        assert flagged == len(stack), (
            f"allocator: {flagged} pages flagged free but the free list holds {len(stack)}"
        )
        assert not self._is_free[0], "allocator: reserved page 0 is marked free"
        for page in stack:
            assert 0 < page <= self._num_pages and self._is_free[page], (
                f"allocator: page {page} on the free list is not flagged free or out of range"
            )

    def __repr__(self) -> str:
        return (
            f"TokenSlotAllocator(size={self._size}, page_size={self.page_size}, "
            f"available={self.available_size()})"
        )
