"""Radix tree over token ids whose values are KV slot ids (prefix sharing; no torch).

Ownership contract (the same as SGLang's RadixCache, with plain lists instead of requests):

* Slots stored in the tree are owned by the tree. They are freed only by ``evict`` (or ``reset``).
* A running request pins its matched prefix with ``inc_lock_ref(last_node)`` and releases it with
  ``dec_lock_ref`` (or through ``cache_finished`` / ``cache_unfinished``). Locked nodes are never
  evicted, so the slots a request got from ``match_prefix`` stay valid while it holds the lock.
* Slots a request allocated itself are the request's until it hands them over with
  ``cache_finished`` / ``cache_unfinished``: those store them in the tree or free the duplicates.
* With ``page_size > 1`` only whole pages are matched and stored: keys are cut to
  ``len // page_size * page_size`` tokens and the tail stays (or is freed as) the caller's.

Invariant (``check_integrity``): free + cached + in use == allocator.size.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

from engine.mem_cache.allocator import TokenSlotAllocator

ChildKey: TypeAlias = int | tuple[int, ...]

MATCH_BLOCK = 64  # tokens compared at once when matching a key against a node's


class TreeNode:
    """One edge of the radix tree: ``key[i]`` is a token id, ``value[i]`` its KV slot id."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id")

    def __init__(
        self, key: list[int], value: list[int], parent: TreeNode | None, node_id: int
    ) -> None:
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        # NOTE: lock_ref counts requests whose matched path passes through this node; it is
        # propagated to every ancestor, so a parent's lock_ref >= each child's.
        self.lock_ref = 0
        self.last_access_time = 0
        self.id = node_id

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
            f"t={self.last_access_time})"
        )


class MatchResult(NamedTuple):
    """``slots``: tree-owned slot ids of the matched prefix; ``last_node``: its deepest node."""

    slots: list[int]
    last_node: TreeNode


class RadixCache:
    """Prefix cache mapping token-id prefixes to KV slot ids.

    ``disable=True`` turns it into a no-op: ``match_prefix`` matches nothing (returns the root),
    ``insert`` stores nothing and returns 0 (the caller frees every slot itself), ``evict`` frees
    nothing, and ``cache_finished`` frees all the given slots.
    """

    def __init__(
        self, allocator: TokenSlotAllocator, page_size: int = 1, disable: bool = False
    ) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size={page_size} differs from the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.reset_tree()

    # ----------------------------------------------------------------------------- bookkeeping

    def reset_tree(self) -> None:
        """Drop every node WITHOUT freeing slots (use after ``allocator.clear()``)."""
        self._next_id = 0
        self._clock = 0
        self.root = self._new_node([], [], None)
        self._num_nodes = 0  # below the root
        self._evictable = 0
        self._protected = 0
        # Eviction candidates, least recently used first: (access time, id, node). Kept across
        # calls and checked when popped (`evict`), so that an eviction costs its own pops, not a
        # walk of the whole tree (25.7 ms a call at 10,000 leaves when it walked). A node has an
        # entry from when it becomes an unlocked leaf; an entry whose node has since been
        # evicted, locked or given a child is dropped, one with an older time pushed again.
        self._lru: list[tuple[int, int, TreeNode]] = []

    def reset(self) -> None:
        """Free every cached slot back to the allocator and empty the tree.

        Raises ValueError if any node is locked (running requests still use their prefixes).
        """
        if self._protected:
            raise ValueError(f"reset: {self._protected} cached tokens are still locked")
        slots = [s for node in self._nodes() for s in node.value]
        self.allocator.free(slots)
        self.reset_tree()

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (can be evicted)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes (pinned by running requests)."""
        return self._protected

    def total_size(self) -> int:
        """Tokens (== slots) held by the tree."""
        return self._evictable + self._protected

    def _new_node(self, key: list[int], value: list[int], parent: TreeNode | None) -> TreeNode:
        node = TreeNode(key, value, parent, self._next_id)
        self._next_id += 1
        if parent is not None:
            self._num_nodes += 1
        return node

    def _push_candidate(self, node: TreeNode) -> None:
        """Give an unlocked leaf its place in the eviction order."""
        heapq.heappush(self._lru, (node.last_access_time, node.id, node))
        if len(self._lru) > 2 * self._num_nodes + 1024:  # mostly dropped entries: rebuild
            self._lru = [
                (n.last_access_time, n.id, n)
                for n in self._nodes()
                if n.is_leaf() and not n.lock_ref
            ]
            heapq.heapify(self._lru)

    def _tick(self) -> int:
        # NOTE: a logical clock, not wall time, so LRU order is deterministic in tests.
        self._clock += 1
        return self._clock

    def _child_key(self, key: Sequence[int]) -> ChildKey:
        """Children are keyed by their first token (page_size 1) or first page tuple."""
        return self._child_key_at(key, 0)

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _child_key_at(self, key: Sequence[int], pos: int) -> ChildKey:
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

    def _match_len(self, node_key: list[int], key: Sequence[int], start: int, end: int) -> int:
        """Length of the common prefix of node_key and key[start:end], in whole pages."""
        n = min(len(node_key), end - start)
        # Compared whole, then a block at a time (list slices compare in C), then token by
        # token inside the first block that differs.
        if node_key[:n] == key[start : start + n]:  # the common case: all of it
            return self._aligned(n)
        i = 0
        while i < n:
            j = min(i + MATCH_BLOCK, n)
            if node_key[i:j] != key[start + i : start + j]:
                break
            i = j
        while i < n and node_key[i] == key[start + i]:
            i += 1
        return self._aligned(i)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after ``n`` tokens; return the new upper node.

        NOTE: the ``child`` object keeps the LOWER part, so a request whose last_node is ``child``
        still holds the deepest node of its prefix and its later dec_lock_ref walks the new upper
        node too. Both parts inherit lock_ref, so evictable/protected sizes do not change.
        """
        parent = child.parent
        assert parent is not None
        upper = self._new_node(child.key[:n], child.value[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def _nodes(self) -> list[TreeNode]:
        """Every node except the root (iterative DFS)."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------------------------ public API

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``token_ids`` (whole pages only); refreshes its access time.

        Splits a node where the match ends inside it. The returned slots are owned by the tree:
        the caller must ``inc_lock_ref(result.last_node)`` before anything can evict, and must not
        free them.
        """
        if self.disable:
            return MatchResult([], self.root)
        now = self._tick()
        node = self.root
        node.last_access_time = now
        slots: list[int] = []
        pos = 0
        end = self._aligned(len(token_ids))
        while pos < end:
            child = node.children.get(self._child_key_at(token_ids, pos))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, token_ids, pos, end)
            ends_inside = n < len(child.key)
            if ends_inside:
                child = self._split(child, n)
            slots.extend(child.value)
            node = child
            pos += n
            if ends_inside:
                break
        return MatchResult(slots, node)

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Store ``slots`` for ``token_ids``; return the length of the prefix ALREADY in the tree.

        Contract: the tree takes ownership of ``slots[prefix_len:aligned_len]`` (the new part).
        For ``i < prefix_len`` the tree keeps its own slot; where ``slots[i]`` differs from it,
        ``slots[i]`` is a duplicate that the caller still owns and must free (equal entries are
        the tree's own slots, which the caller got from ``match_prefix``; never free those).
        ``cache_finished`` / ``cache_unfinished`` do this bookkeeping. With page_size > 1 only
        ``aligned_len = len // page_size * page_size`` tokens are stored; the tail stays the
        caller's. With ``disable`` nothing is stored and 0 is returned.
        """
        return self._insert(token_ids, slots)[0]

    def _insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> tuple[int, list[int]]:
        """insert(); also return the caller's duplicate slots of the already-cached prefix."""
        if len(token_ids) != len(slots):
            raise ValueError(f"insert: {len(token_ids)} token ids but {len(slots)} slots")
        if self.disable:
            return 0, []
        now = self._tick()
        node = self.root
        node.last_access_time = now
        duplicates: list[int] = []
        pos = 0
        end = self._aligned(len(token_ids))
        while pos < end:
            child = node.children.get(self._child_key_at(token_ids, pos))
            if child is None:
                leaf = self._new_node(list(token_ids[pos:end]), list(slots[pos:end]), node)
                leaf.last_access_time = now
                node.children[self._child_key(leaf.key)] = leaf
                self._evictable += end - pos
                self._push_candidate(leaf)
                return pos, duplicates
            child.last_access_time = now
            n = self._match_len(child.key, token_ids, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            for own, cached in zip(slots[pos : pos + n], child.value, strict=True):
                if own != cached:
                    duplicates.append(own)
            node = child
            pos += n
        return pos, duplicates

    def cache_finished(
        self, token_ids: Sequence[int], slots: Sequence[int], last_node: TreeNode | None = None
    ) -> None:
        """A request is done: insert its KV, free its duplicates and unstored tail.

        After this call the caller owns none of ``slots``. If ``last_node`` (the node the request
        locked) is given, its lock is released too; otherwise the caller calls ``dec_lock_ref``.
        """
        if self.disable:
            self.allocator.free(slots)
        else:
            end = self._aligned(len(token_ids))
            _, duplicates = self._insert(token_ids[:end], slots[:end])
            self.allocator.free(duplicates + list(slots[end:]))
        if last_node is not None:
            self.dec_lock_ref(last_node)

    def cache_unfinished(
        self, token_ids: Sequence[int], slots: Sequence[int], old_last_node: TreeNode
    ) -> MatchResult:
        """A request is still running (e.g. after a prefill chunk): cache what it has so far.

        Inserts, frees the caller's duplicates, re-matches, and moves the lock from
        ``old_last_node`` to the new last node. The caller then uses ``result.slots`` (tree-owned,
        locked) as the slots of ``token_ids[:len(result.slots)]`` and keeps ``result.last_node`` to
        unlock later; the slots of the tail ``token_ids[len(result.slots):]`` (page_size > 1, or
        everything when disabled) stay the caller's, unchanged.
        """
        if self.disable:
            return MatchResult([], self.root)
        end = self._aligned(len(token_ids))
        _, duplicates = self._insert(token_ids[:end], slots[:end])
        self.allocator.free(duplicates)
        result = self.match_prefix(token_ids[:end])
        assert len(result.slots) == end, f"re-match found {len(result.slots)} of {end} tokens"
        self.inc_lock_ref(result.last_node)
        self.dec_lock_ref(old_last_node)
        return result

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin the path root..node against eviction (no-op for the root)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``. Raises ValueError if the path is not locked."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError(f"dec_lock_ref: node {node.id} is not locked")
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            if not node.lock_ref and node.is_leaf():
                self._push_candidate(node)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until ``num_tokens`` slots are freed.

        Parents that become unlocked leaves are candidates in the same call. Whole nodes are
        evicted, so more than ``num_tokens`` may be freed. Returns the number of slots freed.
        """
        if self.disable or num_tokens <= 0:
            return 0
        freed: list[int] = []
        while len(freed) < num_tokens and self._lru:
            when, _, node = heapq.heappop(self._lru)
            parent = node.parent
            if parent is None or node.children or node.lock_ref:
                continue  # evicted, or no longer an unlocked leaf: it gets a new entry then
            if when != node.last_access_time:  # used since its entry: back in its place
                heapq.heappush(self._lru, (node.last_access_time, node.id, node))
                continue
            freed.extend(node.value)
            del parent.children[self._child_key(node.key)]
            node.parent = None
            self._num_nodes -= 1
            self._evictable -= len(node.key)
            if parent is not self.root and parent.is_leaf() and not parent.lock_ref:
                self._push_candidate(parent)
        self.allocator.free(freed)
        return len(freed)

    # ------------------------------------------------------------------------------ debugging

    def pretty_print(self) -> str:
        """Return a readable rendering of the tree (one node per line); callers print it."""
        lines = [f"root total={self.total_size()} evictable={self._evictable}"]
        stack = [(child, 1) for child in reversed(list(self.root.children.values()))]
        while stack:
            node, depth = stack.pop()
            lines.append(
                f"{'  ' * depth}key={node.key} value={node.value} "
                f"lock={node.lock_ref} t={node.last_access_time}"
            )
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)

    def check_integrity(self, in_use: int) -> None:
        """Assert the memory invariant; ``in_use`` = slots held by requests (whole pages).

        free + cached + in_use == allocator.size; evictable + protected == cached; every node's
        key/value lengths agree (whole pages); lock refs >= 0 and a parent's >= its child's;
        children are keyed by their first token/page; no slot is cached twice or also free.
        O(tree + pool): for tests and the engine's idle debug check.
        """
        self.allocator.check_integrity()
        total = evictable = protected = 0
        seen: set[int] = set()
        nodes = self._nodes()
        assert len(nodes) == self._num_nodes, f"{self._num_nodes} nodes counted, {len(nodes)} found"
        queued = {id(n) for _, _, n in self._lru}
        for node in nodes:
            nk, nv = len(node.key), len(node.value)
            assert nk == nv, f"node {node.id}: key length {nk} != value length {nv}"
            assert nk > 0 and nk % self.page_size == 0, (
                f"node {node.id}: length {nk} is not a positive multiple of {self.page_size}"
            )
            assert node.lock_ref >= 0, f"node {node.id}: lock_ref {node.lock_ref} < 0"
            parent = node.parent
            assert parent is not None and parent.children.get(self._child_key(node.key)) is node, (
                f"node {node.id}: not linked from its parent under its first token/page"
            )
            if parent is not self.root:
                assert parent.lock_ref >= node.lock_ref, (
                    f"node {node.id}: lock_ref {node.lock_ref} > parent's {parent.lock_ref}"
                )
            if node.is_leaf() and not node.lock_ref:
                assert id(node) in queued, f"node {node.id}: an unlocked leaf not in the LRU order"
            total += nk
            if node.lock_ref:
                protected += nk
            else:
                evictable += nk
            for slot in node.value:
                assert slot not in seen, f"slot {slot} is cached twice"
                assert not self.allocator.is_free(slot), f"slot {slot} is cached and also free"
                seen.add(slot)
        assert evictable == self._evictable, (
            f"evictable_size {self._evictable} != {evictable} counted in the tree"
        )
        assert protected == self._protected, (
            f"protected_size {self._protected} != {protected} counted in the tree"
        )
        free = self.allocator.available_size()
        assert free + total + in_use == self.allocator.size, (
            f"free {free} + cached {total} + in use {in_use} = {free + total + in_use} "
            f"!= pool size {self.allocator.size}"
        )
