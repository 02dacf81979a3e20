"""The consistent-hash ring that maps GCache keys to storage nodes (pure: no IO).

Each node owns `virtual_nodes` points on a 64-bit ring (xxh64 of "<node>#<i>", fixed seed, so every client
agrees); a key is hashed at `PROBES` points (multi-probe consistent hashing) and belongs to the node whose
point follows one of its probes most closely, which keeps every node near its fair share. A key's distance
to a node depends only on that node's points, so a join moves only the keys the new node wins, a leave only
the keys of the node that left. `successors(key, n)` ranks distinct nodes by that distance: the first is
the key's home, the second its replica. Details: docs/gcache.md, "Replication and the ring".
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable

import xxhash

RING_SEED = 0x67636163_68657269  # "gcacheri": node points
PROBE_SEED = 0x67636163_68657072  # "gcachepr": key probes (probe i uses PROBE_SEED + i)
PROBES = 16
_RING = 1 << 64
_MEMO = 1 << 16  # placements remembered (a key is usually asked again: exists, then get); cleared on change


def node_points(node: str, virtual_nodes: int) -> list[int]:
    return [xxhash.xxh64_intdigest(f"{node}#{i}".encode(), seed=RING_SEED) for i in range(virtual_nodes)]


def key_probes(key: str, probes: int = PROBES) -> list[int]:
    data = key.encode()
    return [xxhash.xxh64_intdigest(data, seed=PROBE_SEED + i) for i in range(probes)]


class HashRing:
    """Storage nodes (by instance id) on a ring; see the module docstring."""

    def __init__(self, nodes: Iterable[str] = (), virtual_nodes: int = 64, probes: int = PROBES) -> None:
        if virtual_nodes < 1 or probes < 1:
            raise ValueError(f"virtual_nodes and probes must be >= 1, got {virtual_nodes}, {probes}")
        self.virtual_nodes = virtual_nodes
        self.probes = probes
        self._nodes: set[str] = set()
        self._points: list[int] = []  # sorted
        self._owners: list[str] = []  # owner of each point
        self._memo: OrderedDict[tuple[str, int], list[str]] = OrderedDict()
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._nodes

    def add(self, node: str) -> bool:
        """False when already on the ring."""
        if node in self._nodes:
            return False
        self._nodes.add(node)
        self._rebuild()
        return True

    def remove(self, node: str) -> bool:
        """False when not on the ring."""
        if node not in self._nodes:
            return False
        self._nodes.discard(node)
        self._rebuild()
        return True

    def _rebuild(self) -> None:
        # Ties between points (xxh64 collisions) are broken by node id, so every client builds the same ring.
        pairs = sorted((p, n) for n in self._nodes for p in node_points(n, self.virtual_nodes))
        self._points = [p for p, _ in pairs]
        self._owners = [n for _, n in pairs]
        self._memo.clear()

    def successors(self, key: str, n: int = 1) -> list[str]:
        """Up to `n` distinct nodes for `key`, nearest first (fewer when the ring has fewer nodes)."""
        n = min(n, len(self._nodes))
        if n <= 0:
            return []
        memo = self._memo.get((key, n))
        if memo is not None:
            self._memo.move_to_end((key, n))
            return list(memo)
        found = self._rank(key, n)
        self._memo[(key, n)] = found
        if len(self._memo) > _MEMO:
            self._memo.popitem(last=False)
        return list(found)

    def _rank(self, key: str, n: int) -> list[str]:
        if n == 1:  # the common case, without the walk's bookkeeping
            return [self._nearest(key)]
        best: dict[str, int] = {}
        for probe in key_probes(key, self.probes):
            for node, dist in self._walk(probe, n):
                if dist < best.get(node, _RING):
                    best[node] = dist
        return sorted(best, key=lambda node: (best[node], node))[:n]

    def _nearest(self, key: str) -> str:
        points, owners, size = self._points, self._owners, len(self._points)
        top = (_RING, "")
        for probe in key_probes(key, self.probes):
            i = bisect.bisect_left(points, probe)
            i = i if i < size else 0
            top = min(top, ((points[i] - probe) % _RING, owners[i]))
        return top[1]

    def _walk(self, probe: int, n: int) -> list[tuple[str, int]]:
        """The first `n` distinct nodes clockwise from `probe`, with their distance (exact top-n per probe, so
        the union over probes holds the overall top-n)."""
        points, owners = self._points, self._owners
        start = bisect.bisect_left(points, probe)
        seen: list[tuple[str, int]] = []
        names: set[str] = set()
        for step in range(len(points)):
            i = (start + step) % len(points)
            if owners[i] not in names:
                names.add(owners[i])
                seen.append((owners[i], (points[i] - probe) % _RING))
                if len(seen) == n:
                    break
        return seen

    def home(self, key: str) -> str | None:
        found = self.successors(key, 1)
        return found[0] if found else None

    def check_invariants(self) -> None:
        assert self._points == sorted(self._points)
        assert len(self._points) == len(self._owners) == self.virtual_nodes * len(self._nodes)
        assert set(self._owners) == self._nodes
        assert all(self._rank(key, n) == found for (key, n), found in self._memo.items())
