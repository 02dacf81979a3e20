"""Lower KV tiers: copies of tree nodes below the device pools (the host tier, L2).

The seam is `LowerTier`: the prefix index calls every tier when a node splits or leaves the tree, the front
asks them to back up cold device nodes and for their pool usage, and a hit that reaches a node off the device
asks the node's tier for the copies that load it. A tier keeps its own pools and page ids; this module only
does the bookkeeping (the engine executes the `PageCopy` lists: libs/engine/host_tier.py). `HostTier` is the
only writer of a node's L2 fields (`Node.host_full` / `host_swa`). GCache (L3) imports land in host-tier
pages.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Collection, Iterable, Sequence

from libs.kvcache.events import EventLog
from libs.kvcache.ledger import UnitPagePool, check_pool_ids, check_pool_stats, check_unit_map
from libs.kvcache.pool import PagePool
from libs.kvcache.tree import Node, PromptHashes, ids, no_pages
from libs.kvcache.types import ArenaStats, EventKind, Group, PageCopy, PoolStats, Tier


class LowerTier(ABC):
    """A tier below the device pools holding copies of tree nodes' pages (full pages, and the SWA pages that
    hold KV).

    Contract: a copy covers a whole node; `split` keeps copies aligned with nodes; `free` is called when a node
    leaves the tree or the tier; copies run by the engine before the next cache call that may reuse a source
    page."""

    tier: Tier

    @abstractmethod
    def backup(self, nodes: Collection[Node], max_pages: int, dropped: Callable[[Node], None]) -> list[PageCopy]:
        """Copy cold device nodes down (coldest first, at most `max_pages` pages); make room by dropping the
        tier's own LRU copies, calling `dropped(node)` after each: the index takes a node that lived only in
        this tier out of the tree, and prunes one left with no SWA KV anywhere."""

    @abstractmethod
    def lookup(self, hashes: PromptHashes, start_page: int, max_pages: int) -> int:
        """Pages from `start_page` on whose blocks the tier holds although the tree does not (a shared store
        fed by other workers). 0 for a tier whose copies all hang on tree nodes."""

    def from_store(self, node: Node) -> bool:
        """Was the tier's copy of `node` imported from the shared store (GCache, L3) and not loaded since?"""
        return False

    @abstractmethod
    def swa_count(self, node: Node) -> int:
        """SWA pages with KV in the tier's copy of `node` (0 if it holds none)."""

    @abstractmethod
    def restore(self, node: Node, full: Iterable[int], swa: Iterable[int]) -> tuple[list[int], list[PageCopy]]:
        """Load `node`'s copy onto the device pages given (`full`: one per page; `swa`: one per SWA page with KV,
        in page order): (the node's per-page SWA ids, -1 where none, and the copies to run)."""

    @abstractmethod
    def split(self, head: Node, tail: Node, k: int) -> None:
        """The index split a node into `head` (its first k pages) and `tail` (the rest, the old node)."""

    @abstractmethod
    def free(self, node: Node) -> None:
        """Drop the tier's copy of `node`, if any."""

    @abstractmethod
    def usage(self) -> tuple[PoolStats, PoolStats]:
        """(full, swa) pool stats of the tier."""

    @abstractmethod
    def check_invariants(self, nodes: Collection[Node]) -> None:
        """Audit the tier's pools against the copies `nodes` (all live tree nodes) record."""


class HostTier(LowerTier):
    """L2: host copies of tree nodes (full pages, and the SWA pages that hold KV), recorded on the nodes. Either
    two host page pools (full, SWA) mirroring the device groups, or (`units` > 0) one host arena: both groups'
    pages draw from one budget of units, a full page `fu` units and an SWA page `su` (the device arena's unit
    scheme), each page id mapped to the units it holds (`unit_table`), so the split between the groups follows
    what is backed up."""

    tier = Tier.HOST

    def __init__(self, num_full_pages: int, num_swa_pages: int, events: EventLog, *, units: int = 0, fu: int = 1,
                 su: int = 1, clock: Callable[[], int] | None = None) -> None:
        """`clock`: the index's access clock (the host arena's eviction ages copies by it)."""
        self._units, self._fu, self._su = units, fu, su
        self._clock = clock or (lambda: 0)
        if units:
            self._free_units = array("q", range(units - 1, -1, -1))  # ascending hand-out order, like PagePool
            self._full: PagePool = UnitPagePool("host_full", units // fu, fu, self._free_units)
            self._swa: PagePool = UnitPagePool("host_swa", units // su, su, self._free_units)
        else:
            self._full = PagePool("host_full", num_full_pages)
            self._swa = PagePool("host_swa", num_swa_pages)
        self._events = events
        self._imported: set[int] = set()  # nids of host-only copies imported from GCache (L3), not loaded yet

    @property
    def arena(self) -> bool:
        return self._units > 0

    def unit_table(self, group: str) -> tuple[array, int]:
        """With a host arena: (table, units per page) of `group`, as `ArenaLedger.unit_table` (the engine's host
        KV buffer is indexed by unit and views the table)."""
        pool = self._full if group == "full" else self._swa
        assert isinstance(pool, UnitPagePool), "unit_table: the host tier has no arena"
        return pool.table, pool.per_page

    def _free_units_count(self) -> int:
        f, s = self._full, self._swa
        return self._units - self._fu * (f.capacity - f.num_free) - self._su * (s.capacity - s.num_free)

    def _has_room(self, nf: int, ns: int) -> bool:
        if self._units:
            return self._fu * nf + self._su * ns <= self._free_units_count()
        return self._full.num_free >= nf and self._swa.num_free >= ns

    def _with_units(self, copies: list[PageCopy], side: str) -> list[PageCopy]:
        """With a host arena: the copies with the units their host page (`side`) holds now."""
        if not self._units:
            return copies
        out = []
        for c in copies:
            pool = self._full if c.group == "full" else self._swa
            assert isinstance(pool, UnitPagePool)
            out.append(dataclasses.replace(c, host_units=pool.page_units(getattr(c, side))))
        return out

    def backup(self, nodes: Collection[Node], max_pages: int, dropped: Callable[[Node], None]) -> list[PageCopy]:
        if max_pages <= 0:
            return []
        cands = sorted((n for n in nodes if n.full is not None and n.host_full is None),
                       key=lambda n: (n.access, n.start))
        made: list[tuple[Node, list[PageCopy]]] = []
        budget = max_pages
        fresh: set[int] = set()
        for n in cands:
            if n.npages + n.n_swa > budget or not n.alive or n.full is None:
                continue
            if not self._make_room(n.npages, n.n_swa, nodes, fresh, dropped):
                break
            if not n.alive or n.full is None:
                continue  # dropping a host-only child left `n` an unlocked tombstone leaf: it was pruned
            n.host_full = ids(self._full.alloc(n.npages))
            n.host_swa = no_pages(n.npages)
            mine = [PageCopy(Group.FULL, d, h, "d2h") for d, h in zip(n.full, n.host_full, strict=True)]
            for i, s in enumerate(n.swa):  # type: ignore[arg-type]
                if s >= 0:
                    n.host_swa[i] = self._swa.alloc_one()
                    mine.append(PageCopy(Group.SWA, s, n.host_swa[i], "d2h"))
            budget -= len(mine)
            made.append((n, mine))
            fresh.add(n.nid)
            self._events.emit(EventKind.STORED, Tier.HOST, n)
        # A node backed up here can still leave the tree before the loop ends: a later node's room came from
        # dropping its host-only child, and it was a tombstone (no SWA KV) left an unlocked leaf. Its device
        # and host pages are free then (their units unrecorded, the host pages perhaps handed out again here):
        # its copies must not run.
        return self._with_units([c for n, mine in made if n.alive for c in mine], "dst")

    def make_room(self, nf: int, ns: int, nodes: Collection[Node], keep: set[int],
                  dropped: Callable[[Node], None]) -> bool:
        """Free host pages for an import (see `_make_room`); False if the copies left are all locked or kept."""
        return self._make_room(nf, ns, nodes, keep, dropped)

    def adopt(self, node: Node, swa_from: int) -> tuple[list[int], list[int]]:
        """Give a new host-only node (imported from GCache) host pages: full pages for every page, SWA pages from
        global page `swa_from` on (its checkpoint window). The caller made room (`make_room`) and writes the
        bytes into the pages returned: (full ids, SWA ids in page order)."""
        assert node.full is None and node.host_full is None and node.start <= swa_from < node.end
        k = swa_from - node.start
        node.host_full = ids(self._full.alloc(node.npages))
        swa = self._swa.alloc(node.npages - k)
        node.host_swa = no_pages(k) + ids(swa)
        self._imported.add(node.nid)
        self._events.emit(EventKind.STORED, Tier.HOST, node)
        return list(node.host_full), list(swa)

    def from_store(self, node: Node) -> bool:
        return node.nid in self._imported

    def _make_room(self, nf: int, ns: int, nodes: Collection[Node], keep: set[int],
                   dropped: Callable[[Node], None]) -> bool:
        """Free host pages by dropping copies: of unlocked device nodes (the node stays), or host-only leaves
        (the node leaves the tree). Copies made in this backup (`keep`) stay. Two pools: the LRU copy goes. One
        arena: the copy that saves the least recompute per unit it holds, by LRU age (its tokens / (units x
        age), as the device arena scores a full-KV leaf), so a copy heavy in SWA pages goes before an equally
        old full-only one."""
        while not self._has_room(nf, ns):
            victims = [n for n in nodes if n.host_full is not None and n.nid not in keep and (
                (n.full is not None and n.lock == 0) or (n.full is None and not n.children))]
            if not victims:
                return False
            if self._units:
                clock, fu, su = self._clock() + 1, self._fu, self._su
                v = min(victims, key=lambda n: (n.npages / ((fu * n.npages + su * n.host_swa_count())
                                                            * max(1, clock - n.access)), n.access, -n.start))
            else:
                v = min(victims, key=lambda n: (n.access, -n.start))
            self.free(v)
            dropped(v)  # a device node whose SWA KV was only here is a tombstone now: it may have to go
        return True

    def lookup(self, hashes: PromptHashes, start_page: int, max_pages: int) -> int:
        return 0  # every host copy hangs on a tree node: the walk of `match` finds it

    def swa_count(self, node: Node) -> int:
        return node.host_swa_count()

    def restore(self, node: Node, full: Iterable[int], swa: Iterable[int]) -> tuple[list[int], list[PageCopy]]:
        self._imported.discard(node.nid)  # on the device from now on: a later hit on it is an L1 hit
        copies = [PageCopy(Group.FULL, h, d, "h2d") for h, d in zip(node.host_full, full, strict=True)]  # type: ignore[arg-type]
        dev_swa = [-1] * node.npages
        free_swa = iter(swa)
        for i, h in enumerate(node.host_swa):  # type: ignore[arg-type]
            if h >= 0:
                dev_swa[i] = d = next(free_swa)
                copies.append(PageCopy(Group.SWA, h, d, "h2d"))
        return dev_swa, self._with_units(copies, "src")

    def split(self, head: Node, tail: Node, k: int) -> None:
        if tail.nid in self._imported:
            self._imported.add(head.nid)
        if tail.host_full is not None:
            head.host_full, head.host_swa = tail.host_full[:k], tail.host_swa[:k]  # type: ignore[index]
            tail.host_full, tail.host_swa = tail.host_full[k:], tail.host_swa[k:]  # type: ignore[index]

    def free(self, node: Node) -> None:
        if node.host_full is None:
            return
        self._events.emit(EventKind.REMOVED, Tier.HOST, node)
        self._imported.discard(node.nid)
        self._full.free(node.host_full)
        self._swa.free(s for s in node.host_swa if s >= 0)  # type: ignore[union-attr]
        node.host_full = node.host_swa = None

    def usage(self) -> tuple[PoolStats, PoolStats]:
        """(full, SWA) pages; with a host arena the free pages are what the free units would hold of that group
        (so free + cached == capacity per group, capacity moving with the other group's use)."""
        if not self._units:
            return _host_stats(self._full), _host_stats(self._swa)
        fr = self._free_units_count()
        out = []
        for pool, per in ((self._full, self._fu), (self._swa, self._su)):
            used = pool.capacity - pool.num_free
            out.append(PoolStats(used + fr // per, fr // per, used, 0))
        return out[0], out[1]

    def arena_stats(self) -> ArenaStats | None:
        """The host arena in units (copies are all cache: in use 0); None with two host pools."""
        if not self._units:
            return None
        f, s = self._full, self._swa
        return ArenaStats(self._units, self._free_units_count(), 0, self._fu * (f.capacity - f.num_free), 0,
                          self._su * (s.capacity - s.num_free))

    def check_invariants(self, nodes: Collection[Node]) -> None:
        """Per host pool: every page is free or in exactly one node's copy; copies are as long as their node;
        imported copies are live host-only nodes."""
        full: list[int] = []
        swa: list[int] = []
        host_only = {n.nid for n in nodes if n.full is None and n.host_full is not None}
        if not self._imported <= host_only:
            raise AssertionError(f"imported copies {sorted(self._imported - host_only)} are not live host-only nodes")
        for n in nodes:
            if n.host_full is None:
                if n.host_swa is not None:
                    raise AssertionError(f"node {n.nid}: a host SWA mask without host full pages")
                continue
            if len(n.host_full) != n.npages or n.host_swa is None or len(n.host_swa) != n.npages:
                raise AssertionError(f"node {n.nid} (pages {n.start}..{n.end}): host page list lengths differ from "
                                     "npages")
            full += n.host_full
            swa += [s for s in n.host_swa if s >= 0]
        for (name, st), pool, owned in zip(zip(("host_full", "host_swa"), self.usage(), strict=True),
                                          (self._full, self._swa), (full, swa), strict=True):
            check_pool_stats(name, st)
            check_pool_ids(pool, owned)
        a = self.arena_stats()
        if a is not None:  # units free + cached + in use == host arena, and the unit map agrees
            want = self._fu * len(full) + self._su * len(swa)
            if a.free < 0 or a.free + a.full_cached + a.swa_cached + a.full_in_use + a.swa_in_use != a.units or (
                    a.full_cached + a.swa_cached != want):
                raise AssertionError(f"host arena: free {a.free} + cached {a.full_cached} / {a.swa_cached} != "
                                     f"{a.units} units, or the copies hold {want}")
            pools = [p for p in (self._full, self._swa) if isinstance(p, UnitPagePool)]
            check_unit_map("host arena", pools, self._free_units, self._units, a.units - a.free)


def _host_stats(pool: PagePool) -> PoolStats:
    return PoolStats(pool.capacity, pool.num_free, pool.capacity - pool.num_free, 0)


NO_TIER_USAGE = (PoolStats(0, 0, 0, 0), PoolStats(0, 0, 0, 0))


def split_copies(copies: Sequence[PageCopy], direction: str) -> dict[str, tuple[list[int], list[int]]]:
    """The plan of one step's copies: {layer group: (src ids, dst ids)}; checks the direction (`last_copies`)."""
    return {g: ([c.src for c in cs], [c.dst for c in cs]) for g, cs in last_copies(copies, direction).items()}


def last_copies(copies: Sequence[PageCopy], direction: str) -> dict[str, list[PageCopy]]:
    """One step's copies per layer group, the last one per target page; checks the direction. (The engine
    executes them, one indexed copy per pool tensor: libs/engine/host_tier.py.)

    A destination page may appear twice in one step's list (a page loaded for a probe, evicted and
    reused for another load); the later copy is the live one, and one vectorised index assignment
    with duplicate targets would pick a winner arbitrarily, so only the last copy per target is kept."""
    last: dict[str, dict[int, PageCopy]] = {"full": {}, "swa": {}}
    for c in copies:
        if c.direction != direction:
            raise ValueError(f"expected {direction} page copies, got {c.direction} ({c})")
        target = last.get(c.group)
        if target is None:
            raise ValueError(f"unknown page-copy group {c.group!r} (expected 'full' or 'swa')")
        target.pop(c.dst, None)
        target[c.dst] = c
    return {g: list(m.values()) for g, m in last.items() if m}
