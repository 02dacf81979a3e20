"""The evictor: which tree node goes next. Full LRU over unlocked device leaves, SWA LRU over any node whose SWA
nobody reads (cold checkpoint kinds first).

It owns only the two heaps; the prefix index executes an eviction (it owns the nodes), and running sequences'
lazily kept pages compete with `swa_top_key` (see `KVCache._make_room`). Heaps are lazy: stale entries are
skipped or re-pushed with the node's current key, and a dry heap is rebuilt once from all nodes, so a missed
push can never lose evictable memory.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping

from libs.kvcache.tree import Node

_HeapEntry = tuple[int, int, int, Node]
_WARM = 1 << 48  # added to the SWA LRU key of checkpoints of kinds that get reused: they go after cold ones


def full_evictable(n: Node) -> bool:
    return n.alive and n.full is not None and n.lock == 0 and not n.has_device_child()


def swa_evictable(n: Node) -> bool:
    return n.alive and n.n_swa > 0 and n.swa_lock == 0


def full_key(n: Node) -> int:
    """Full LRU order over leaves. (No cold-first order needed: the SWA LRU already drops a cold leaf's
    checkpoint first, and the tombstone leaf then leaves the tree with its full pages.)"""
    return n.access


class Evictor:
    __slots__ = ("_nodes", "_cold", "_full", "_swa", "_limit")

    def __init__(self, nodes: Mapping[int, Node], cold: Callable[[int], bool]) -> None:
        """`nodes`: the prefix index's node map (read to rebuild a heap); `cold`: whether checkpoint kinds are
        cold (the reuse statistics)."""
        self._nodes = nodes
        self._cold = cold
        self._full: list[_HeapEntry] = []
        self._swa: list[_HeapEntry] = []
        # per heap, its size bound at the last push (nodes removed since shrink the node map, not the heap)
        self._limit = {"full": 256, "swa": 256}

    def swa_key(self, n: Node) -> int:
        """SWA LRU order: cold checkpoints first, then the rest, each by recency."""
        return n.swa_access if self._cold(n.kinds) else n.swa_access + _WARM

    def push_full(self, node: Node) -> None:
        """`node` may have become a full-LRU candidate (or its stamp changed)."""
        if node.parent is not None:
            self._push(self._full, (node.access, -node.start, node.nid, node))

    def push_swa(self, node: Node) -> None:
        """`node` may have become an SWA-LRU candidate (or its key changed)."""
        if node.parent is not None:
            key = node.swa_access if self._cold(node.kinds) else node.swa_access + _WARM  # swa_key, inlined
            self._push(self._swa, (key, -node.start, node.nid, node))

    def _push(self, heap: list[_HeapEntry], entry: _HeapEntry) -> None:
        heapq.heappush(heap, entry)
        limit = self._limit["full" if heap is self._full else "swa"] = 4 * len(self._nodes) + 256
        if len(heap) > limit:
            self._rebuild(heap)

    def pop_full(self) -> Node | None:
        """The least recently used unlocked device leaf, taken off the heap; None if there is none."""
        return self._pop(self._full, full_evictable, full_key)

    def pop_swa(self) -> Node | None:
        """The next SWA victim (cold first, then LRU), taken off the heap; None if there is none."""
        return self._pop(self._swa, swa_evictable, self.swa_key)

    def _pop(self, heap: list[_HeapEntry], ok: Callable[[Node], bool], key: Callable[[Node], int]) -> Node | None:
        node = self._peek(heap, ok, key)
        if node is not None:
            heapq.heappop(heap)
        return node

    def peek_full(self) -> Node | None:
        """The next full-LRU victim, left on the heap (the arena compares it with the SWA side first)."""
        return self._peek(self._full, full_evictable, full_key)

    def peek_swa(self) -> Node | None:
        """The next SWA victim, left on the heap."""
        return self._peek(self._swa, swa_evictable, self.swa_key)

    def _peek(self, heap: list[_HeapEntry], ok: Callable[[Node], bool], key: Callable[[Node], int]) -> Node | None:
        """The top victim, fixing stale entries at the top in place (no pop and push of a valid one)."""
        for attempt in range(2):
            while heap:
                acc, _, _, node = heap[0]
                if not ok(node):
                    heapq.heappop(heap)
                    continue
                k = key(node)
                if k != acc:
                    heapq.heapreplace(heap, (k, -node.start, node.nid, node))
                    continue
                return node
            if attempt == 0:
                self._rebuild(heap)
        return None

    def swa_top_key(self) -> float:
        """The SWA LRU key of the next victim (stale entries at the top fixed first), inf if none."""
        heap = self._swa
        while heap:
            acc, _, _, node = heap[0]
            if not swa_evictable(node):
                heapq.heappop(heap)
            elif self.swa_key(node) != acc:
                heapq.heapreplace(heap, (self.swa_key(node), -node.start, node.nid, node))
            else:
                return acc
        return math.inf

    def rekey_swa(self) -> None:
        """The cold kinds changed: the SWA order of every node may have."""
        self._rebuild(self._swa)

    def _rebuild(self, heap: list[_HeapEntry]) -> None:
        ok, key = (full_evictable, full_key) if heap is self._full else (swa_evictable, self.swa_key)
        heap[:] = [(key(n), -n.start, n.nid, n) for n in self._nodes.values() if ok(n)]
        heapq.heapify(heap)

    def check_invariants(self) -> None:
        """Both heaps are heaps (a corrupted order would evict the wrong nodes) and stay bounded (by 4 entries per
        node of the tree as it was at the heap's last push, plus 256; pops only shrink a heap)."""
        for name, heap in (("full", self._full), ("swa", self._swa)):
            bad = [i for i in range(1, len(heap)) if heap[i][:3] < heap[(i - 1) // 2][:3]]
            if bad:
                raise AssertionError(f"{name} eviction heap out of order at entries {bad[:5]}")
            if len(heap) > self._limit[name]:
                raise AssertionError(f"{name} eviction heap holds {len(heap)} entries, over its bound "
                                     f"{self._limit[name]}")
