"""RadixCache: matching, splitting, locking, LRU eviction, paging, and a randomized simulation."""

from __future__ import annotations

import heapq
import random

import pytest

from engine.mem_cache.allocator import TokenSlotAllocator
from engine.mem_cache.radix_cache import RadixCache, TreeNode


def make(size: int = 32, page_size: int = 1, disable: bool = False) -> RadixCache:
    return RadixCache(TokenSlotAllocator(size, page_size), page_size=page_size, disable=disable)


def alloc(cache: RadixCache, n: int) -> list[int]:
    slots = cache.allocator.alloc(n)
    assert slots is not None
    return slots


def test_empty_match_returns_root() -> None:
    cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.slots == [] and m.last_node is cache.root
    assert cache.total_size() == 0
    cache.check_integrity(0)


def test_insert_then_match_and_prefix_len() -> None:
    cache = make()
    s = alloc(cache, 4)
    assert cache.insert([1, 2, 3, 4], s) == 0
    assert cache.total_size() == 4 and cache.evictable_size() == 4
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.slots == s
    assert m.last_node.key == [1, 2, 3, 4]
    # Re-inserting the same prefix with other slots: the caller's copies are duplicates.
    dup = alloc(cache, 4)
    assert cache.insert([1, 2, 3, 4], dup) == 4
    cache.allocator.free(dup)
    cache.check_integrity(0)


def test_match_splits_node_mid_key() -> None:
    cache = make()
    s = alloc(cache, 5)
    cache.insert([1, 2, 3, 4, 5], s)
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.slots == s[:3]
    assert m.last_node.key == [1, 2, 3]
    (lower,) = m.last_node.children.values()
    assert lower.key == [4, 5] and lower.value == s[3:]
    assert lower.parent is m.last_node
    assert cache.total_size() == 5
    cache.check_integrity(0)


def test_insert_splits_and_branches() -> None:
    cache = make()
    a = alloc(cache, 4)
    cache.insert([1, 2, 3, 4], a)
    b = alloc(cache, 4)
    assert cache.insert([1, 2, 7, 8], b) == 2
    cache.allocator.free(b[:2])
    assert cache.total_size() == 6
    assert cache.match_prefix([1, 2, 7, 8]).slots == a[:2] + b[2:]
    assert cache.match_prefix([1, 2, 3, 4]).slots == a
    mid = cache.match_prefix([1, 2]).last_node
    assert sorted(mid.children) == [3, 7]
    cache.check_integrity(0)
    assert "key=[1, 2]" in cache.pretty_print()


def test_cache_finished_frees_only_duplicates() -> None:
    cache = make(16)
    first = alloc(cache, 3)
    cache.cache_finished([1, 2, 3], first)
    # Second request matched [1, 2] (tree slots), allocated the rest itself.
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.slots == first
    cache.inc_lock_ref(m.last_node)
    own = alloc(cache, 1)
    cache.check_integrity(1)
    cache.cache_finished([1, 2, 3, 4], m.slots + own, m.last_node)
    assert cache.total_size() == 4 and cache.protected_size() == 0
    cache.check_integrity(0)
    # A third request computed [1, 2, 3, 4] without sharing: all four are duplicates.
    dup = alloc(cache, 4)
    cache.cache_finished([1, 2, 3, 4], dup)
    assert cache.total_size() == 4
    assert cache.allocator.available_size() == 12
    cache.check_integrity(0)


def test_cache_unfinished_moves_lock() -> None:
    cache = make(16)
    s = alloc(cache, 4)
    res = cache.cache_unfinished([5, 6, 7, 8], s, cache.root)
    assert res.slots == s and res.last_node.key == [5, 6, 7, 8]
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.check_integrity(0)
    more = alloc(cache, 2)
    res2 = cache.cache_unfinished([5, 6, 7, 8, 9, 10], res.slots + more, res.last_node)
    assert res2.slots == s + more
    assert res.last_node.lock_ref == 1 and res2.last_node.lock_ref == 1
    assert cache.protected_size() == 6
    cache.dec_lock_ref(res2.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    cache.check_integrity(0)


def test_cache_unfinished_replaces_duplicates_with_tree_slots() -> None:
    cache = make(16)
    tree = alloc(cache, 3)
    cache.insert([1, 2, 3], tree)
    mine = alloc(cache, 4)  # computed without a prefix hit (e.g. inserted concurrently)
    res = cache.cache_unfinished([1, 2, 3, 4], mine, cache.root)
    assert res.slots == tree + [mine[3]]
    assert all(cache.allocator.is_free(s) for s in mine[:3])
    cache.dec_lock_ref(res.last_node)
    cache.check_integrity(0)


def test_lock_protects_from_eviction_and_sizes() -> None:
    cache = make(16)
    s = alloc(cache, 4)
    cache.insert([1, 2, 3, 4], s)
    m = cache.match_prefix([1, 2])  # splits: [1,2] -> [3,4]
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 2 and cache.evictable_size() == 2
    assert cache.evict(100) == 2  # only the unlocked leaf [3, 4]
    assert cache.total_size() == 2
    assert cache.evict(100) == 0
    cache.check_integrity(0)
    cache.dec_lock_ref(m.last_node)
    assert cache.evictable_size() == 2 and cache.protected_size() == 0
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock_ref(m.last_node)
    assert cache.evict(1) == 2
    assert cache.total_size() == 0 and cache.allocator.available_size() == 16
    cache.check_integrity(0)


def test_split_keeps_locks_on_both_parts() -> None:
    cache = make(16)
    s = alloc(cache, 4)
    cache.insert([1, 2, 3, 4], s)
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    cache.match_prefix([1, 2, 9])  # splits the locked node
    assert cache.protected_size() == 4
    cache.check_integrity(0)
    cache.dec_lock_ref(m.last_node)  # the old last node is still the deepest part
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    cache.check_integrity(0)


def test_evict_lru_order_and_parents_become_leaves() -> None:
    cache = make(16)
    for prompt in ([1, 2, 3], [1, 2, 4], [5, 6]):
        cache.cache_finished(prompt, alloc(cache, len(prompt)))
    # [1,2] -> {[3], [4]}, [5,6]. Touch [1,2,3] so [1,2,4] is the oldest leaf, then [5,6].
    cache.match_prefix([1, 2, 3])
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 2, 4]).slots != []  # [1, 2] still cached
    assert len(cache.match_prefix([1, 2, 4]).slots) == 2
    cache.match_prefix([1, 2, 3])
    assert cache.evict(2) == 2  # [5, 6] is now the least recently used
    assert cache.match_prefix([5, 6]).slots == []
    # Evicting [3] makes [1, 2] a leaf, evicted in the same call.
    assert cache.evict(3) == 3
    assert cache.total_size() == 0
    cache.check_integrity(0)


def test_eviction_entries_stay_bounded_and_in_order() -> None:
    """Requests that lock and release the same cached prompts leave entries behind in the
    eviction order; they are dropped when they pile up, and eviction still takes the least
    recently used prompt first."""
    cache = make(64)
    prompts = [[10 * i + k for k in range(4)] for i in range(3)]
    for prompt in prompts:
        cache.cache_finished(prompt, alloc(cache, 4))
    for turn in range(3000):
        m = cache.match_prefix(prompts[turn % 3])
        cache.inc_lock_ref(m.last_node)
        cache.dec_lock_ref(m.last_node)
        assert len(cache._lru) <= 2 * 3 + 1024 + 1
    cache.check_integrity(0)
    cache.match_prefix(prompts[0])  # the order now: prompts 1, 2, 0
    assert cache.evict(4) == 4
    assert cache.match_prefix(prompts[1]).slots == []
    assert [len(cache.match_prefix(prompts[i]).slots) for i in (0, 2)] == [4, 4]
    cache.check_integrity(0)


def test_evict_zero_and_reset() -> None:
    cache = make(16)
    cache.cache_finished([1, 2, 3], alloc(cache, 3))
    assert cache.evict(0) == 0
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    with pytest.raises(ValueError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(m.last_node)
    cache.reset()
    assert cache.total_size() == 0 and cache.allocator.available_size() == 16
    cache.check_integrity(0)


def test_disabled_cache_stores_nothing() -> None:
    cache = make(16, disable=True)
    s = alloc(cache, 4)
    assert cache.insert([1, 2, 3, 4], s) == 0
    assert cache.match_prefix([1, 2, 3, 4]).slots == []
    cache.check_integrity(4)
    res = cache.cache_unfinished([1, 2, 3, 4], s, cache.root)
    assert res.slots == [] and res.last_node is cache.root
    cache.inc_lock_ref(res.last_node)
    cache.cache_finished([1, 2, 3, 4], s, res.last_node)
    assert cache.allocator.available_size() == 16 and cache.evict(10) == 0
    cache.check_integrity(0)


def test_check_integrity_detects_breakage() -> None:
    cache = make(16)
    s = alloc(cache, 4)
    cache.insert([1, 2, 3, 4], s)
    with pytest.raises(AssertionError, match="in use 1"):
        cache.check_integrity(1)
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    node.value.append(99)
    with pytest.raises(AssertionError, match="value length 5"):
        cache.check_integrity(0)
    node.value.pop()
    cache.allocator.free([s[0]])  # slot both cached and free
    with pytest.raises(AssertionError, match=f"slot {s[0]} is cached and also free"):
        cache.check_integrity(-1)
    cache.allocator.alloc(1)
    node.lock_ref = 1  # lock without updating the counters
    with pytest.raises(AssertionError, match="evictable_size 4 != 0"):
        cache.check_integrity(0)


def test_page_size_mismatch_rejected() -> None:
    with pytest.raises(ValueError):
        RadixCache(TokenSlotAllocator(16, 4), page_size=1)


# ------------------------------------------------------------------------------- page_size 4


def test_paged_match_is_whole_pages_only() -> None:
    cache = make(32, page_size=4)
    s = alloc(cache, 8)
    toks = list(range(100, 110))  # 10 tokens: 2 whole pages + 2 tail tokens
    tail = cache.allocator.alloc_pages(1)
    assert tail is not None
    cache.cache_finished(toks, s + [tail[0], tail[0] + 1])
    assert cache.total_size() == 8 and cache.allocator.is_free(tail[0])
    assert cache.match_prefix(toks[:7]).slots == s[:4]  # 1 whole page of 7 tokens
    assert cache.match_prefix(toks[:3]).slots == []
    # Diverging inside the second page matches only the first page and splits there.
    m = cache.match_prefix(toks[:6] + [0, 0])
    assert m.slots == s[:4] and m.last_node.key == toks[:4]
    assert list(m.last_node.children) == [tuple(toks[4:8])]
    cache.check_integrity(0)


def test_paged_insert_and_evict() -> None:
    cache = make(32, page_size=4)
    a = alloc(cache, 8)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], a) == 0
    b = alloc(cache, 8)
    assert cache.insert([1, 2, 3, 4, 5, 6, 0, 0], b) == 4  # shares only the first page
    cache.allocator.free(b[:4])
    assert cache.total_size() == 12
    assert cache.evict(1) == 4  # one whole page leaf
    assert cache.evict(100) == 8
    assert cache.allocator.available_size() == 32
    cache.check_integrity(0)


def test_paged_cache_unfinished_keeps_tail() -> None:
    cache = make(32, page_size=4)
    pages = cache.allocator.alloc_pages(2)
    assert pages is not None
    slots = cache.allocator.pages_to_slots(pages)[:6]
    res = cache.cache_unfinished([1, 2, 3, 4, 5, 6], slots, cache.root)
    assert res.slots == slots[:4]
    assert cache.protected_size() == 4
    cache.check_integrity(4)  # the tail page is still the caller's
    cache.cache_finished([1, 2, 3, 4, 5, 6], res.slots + slots[4:], res.last_node)
    assert cache.total_size() == 4 and cache.allocator.available_size() == 28
    cache.check_integrity(0)


# ------------------------------------------------------------------------- randomized check


class SimReq:
    """A request in the simulation: its tokens, one slot per token, and the pages it owns."""

    def __init__(self, tokens: list[int], slots: list[int], last_node: TreeNode) -> None:
        self.tokens = tokens
        self.slots = slots
        self.last_node = last_node
        self.owned: set[int] = set()  # first slot of every page (slot if page_size 1) it owns


def check_tree_slots(cache: RadixCache, slot_prefix: dict[int, tuple[int, ...]]) -> None:
    """Every cached slot holds the KV of exactly the token path that leads to it."""
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for i, slot in enumerate(node.value):
            assert slot_prefix[slot] == path + tuple(node.key[: i + 1])
        path = path + tuple(node.key)
        stack.extend((c, path) for c in node.children.values())


def naive_evict(cache: RadixCache, num_tokens: int) -> set[int]:
    """The slots that evicting `num_tokens` frees, found by walking the whole tree (the
    eviction order by definition: least recently used unlocked leaf first, ties by node id,
    a parent a candidate once its last child goes); the tree is not changed."""
    children = {id(n): len(n.children) for n in cache._nodes()}
    heap = [(n.last_access_time, n.id, n) for n in cache._nodes() if not n.children]
    heap = [e for e in heap if not e[2].lock_ref]
    heapq.heapify(heap)
    freed: set[int] = set()
    while len(freed) < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        freed.update(node.value)
        parent = node.parent
        assert parent is not None
        if parent is not cache.root:
            children[id(parent)] -= 1
            if not children[id(parent)] and not parent.lock_ref:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
    return freed


def cached_slots(cache: RadixCache) -> set[int]:
    return {s for n in cache._nodes() for s in n.value}


@pytest.mark.parametrize(("page_size", "size", "seed"), [(1, 48, 0), (1, 32, 1), (4, 64, 2)])
def test_randomized_simulation(page_size: int, size: int, seed: int) -> None:
    rng = random.Random(seed)
    cache = make(size, page_size)
    alloc_ = cache.allocator
    p = page_size
    prompts = [[rng.randrange(1, 6) for _ in range(rng.randrange(2, 10))] for _ in range(4)]
    slot_prefix: dict[int, tuple[int, ...]] = {}
    running: list[SimReq] = []
    held: set[int] = set()  # pages owned by running requests

    def page_of(slot: int) -> int:
        return slot - slot % p

    def take(req: SimReq, n_new: int) -> bool:
        """Give req slots for n_new more tokens (whole pages), evicting under pressure."""
        cur = len(req.slots)
        need_pages = -(-(cur + n_new) // p) - (-(-cur // p))
        if need_pages * p > alloc_.available_size():
            short = need_pages * p - alloc_.available_size()
            before, expected = cached_slots(cache), naive_evict(cache, short)
            assert cache.evict(short) == len(expected)
            assert before - cached_slots(cache) == expected
        firsts = alloc_.alloc_pages(need_pages)
        if firsts is None:
            return False
        held.update(firsts)
        req.owned.update(firsts)
        fresh: list[int] = []
        if cur % p:
            fresh = list(range(req.slots[-1] + 1, page_of(req.slots[-1]) + p))
        fresh = (fresh + alloc_.pages_to_slots(firsts))[:n_new]
        for i, slot in enumerate(fresh):
            slot_prefix[slot] = tuple(req.tokens[: cur + i + 1])
        req.slots.extend(fresh)
        return True

    def finish(req: SimReq) -> None:
        cache.cache_finished(req.tokens, req.slots, req.last_node)
        held.difference_update(req.owned)
        running.remove(req)

    def check() -> None:
        cache.check_integrity(len(held) * p)
        for req in running:
            assert len(req.slots) == len(req.tokens)
            for i, slot in enumerate(req.slots):
                assert slot_prefix[slot] == tuple(req.tokens[: i + 1])
        check_tree_slots(cache, slot_prefix)

    hits = 0
    for _ in range(1500):
        action = rng.random()
        if action < 0.35 or not running:
            base = rng.choice(prompts)
            tokens = base[: rng.randrange(1, len(base) + 1)]
            tokens += [rng.randrange(1, 6) for _ in range(rng.randrange(0, 5))]
            m = cache.match_prefix(tokens)
            assert len(m.slots) % p == 0
            for i, slot in enumerate(m.slots):
                assert slot_prefix[slot] == tuple(tokens[: i + 1])
            hits += len(m.slots)
            cache.inc_lock_ref(m.last_node)
            req = SimReq(tokens, list(m.slots), m.last_node)  # prefix slots are tree-owned
            running.append(req)
            if not take(req, len(tokens) - len(m.slots)):
                req.tokens = tokens[: len(m.slots)]
                finish(req)
        elif action < 0.75:
            req = rng.choice(running)
            req.tokens.append(rng.randrange(1, 6))
            if not take(req, 1):
                req.tokens.pop()
                finish(req)
        elif action < 0.85:
            # Chunked-prefill style: cache what the request has so far and keep running.
            req = rng.choice(running)
            res = cache.cache_unfinished(req.tokens, req.slots, req.last_node)
            tail = req.slots[len(res.slots) :]
            req.slots = res.slots + tail
            req.last_node = res.last_node
            held.difference_update(req.owned)
            req.owned = {page_of(s) for s in tail}
            held.update(req.owned)
        else:
            finish(rng.choice(running))
        check()
    for req in list(running):
        finish(req)
    check()
    assert cache.protected_size() == 0
    assert hits > 0
    cache.evict(size)
    assert alloc_.available_size() == size
    check()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("differs_at", [0, 1, 62, 63, 64, 65, 127, 128, 150, 199, None])
def test_long_keys_match_up_to_the_first_difference(page_size: int, differs_at: int | None) -> None:
    """Keys are compared a block at a time: a difference anywhere (at a block's edge too)
    ends the match there, rounded down to whole pages."""
    cache = make(size=512, page_size=page_size)
    key = list(range(1000, 1200))
    slots = alloc(cache, 200)
    cache.insert(key, slots)
    query = list(key) + [5]
    if differs_at is not None:
        query[differs_at] = 7
    expected = 200 if differs_at is None else differs_at // page_size * page_size
    assert cache.match_prefix(query).slots == slots[:expected]
    cache.check_integrity(0)
