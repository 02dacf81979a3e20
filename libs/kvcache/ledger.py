"""The page ledger: the two device pools and the accounting of every device page.

A device page is in exactly one state (free, private, lazy, in the tree, locked in the tree) and only the
ledger's transitions move it, per operation, never per page; so per pool free + cached + in_use ==
capacity. Nothing is handed out unless free + cached stays >= `reserved` (what admission promised running
sequences). Callers pair each transition with their own record of the pages; `check_invariants` checks
both agree. `ArenaLedger` keeps the interface over one unit budget for both groups. Details:
docs/kvcache.md, "Parts" and "One arena".
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from libs.kvcache.pool import PagePool
from libs.kvcache.types import ArenaStats, PoolStats


@dataclass(slots=True)
class Held:
    """Device pages one part says it holds, recomputed from its own records (for `check_invariants`)."""

    full: list[int] = field(default_factory=list)
    swa: list[int] = field(default_factory=list)
    locked_full: int = 0  # tree: of `full` / `swa`, pages on locked (lock / swa_lock > 0) nodes
    locked_swa: int = 0
    lazy_swa: list[int] = field(default_factory=list)  # running sequences: lazily kept SWA pages
    reserved_full: int = 0  # running sequences: promised, not yet allocated
    reserved_swa: int = 0


class PageLedger:
    __slots__ = ("_full", "_swa", "_tree_f", "_tree_s", "_locked_f", "_locked_s", "_private_f", "_private_s",
                 "_reserved_f", "_reserved_s", "_lazy_s")

    def __init__(self, num_full_pages: int, num_swa_pages: int) -> None:
        self._full = PagePool("full", num_full_pages)
        self._swa = PagePool("swa", num_swa_pages)
        self._tree_f = self._tree_s = 0  # device pages owned by tree nodes
        self._locked_f = self._locked_s = 0  # ... of which locked (lock > 0 / swa_lock > 0)
        self._private_f = self._private_s = 0  # pages owned by running sequences
        self._reserved_f = self._reserved_s = 0  # promised, not yet allocated
        self._lazy_s = 0  # running sequences' lazily kept checkpoint pages (cached: reclaimable at any time)

    # ------------------------------------------------------------------ reads

    def avail_full(self) -> int:
        """Full pages that can be handed out: free + evictable - promised."""
        return self._full.num_free + self._tree_f - self._locked_f - self._reserved_f

    def avail_swa(self) -> int:
        return self._swa.num_free + self._tree_s - self._locked_s + self._lazy_s - self._reserved_s

    def has_free(self, nf: int, ns: int) -> bool:
        """Both free lists hold this many pages now (nothing to evict)."""
        return self._full.num_free >= nf and self._swa.num_free >= ns

    def fits(self, nf: int, ns: int) -> bool:
        """nf full and ns SWA pages more can be handed out (after evicting unlocked cache) without breaking a
        promise."""
        return nf <= self.avail_full() and ns <= self.avail_swa()

    def free_full(self) -> int:
        return self._full.num_free

    def free_swa(self) -> int:
        return self._swa.num_free

    def lazy_swa(self) -> int:
        """SWA pages running sequences keep lazily (cached memory)."""
        return self._lazy_s

    def spare_free_swa(self) -> int:
        """Free SWA pages nobody was promised (taking them evicts nothing)."""
        return self._swa.num_free - self._reserved_s

    def shortfall(self, need_full: int, need_swa: int) -> tuple[str, int, int, int, int, int] | None:
        """None if a promise of this many pages fits; else (pool, need, available, free, evictable, promised)
        of the first pool that cannot hold it."""
        for name, need, avail, free, cached, reserved in (
                ("full", need_full, self.avail_full(), self._full.num_free, self._tree_f - self._locked_f,
                 self._reserved_f),
                ("swa", need_swa, self.avail_swa(), self._swa.num_free, self._tree_s - self._locked_s,
                 self._reserved_s)):
            if need > avail:
                return name, need, max(avail, 0), free, cached, reserved
        return None

    def usage(self) -> tuple[PoolStats, PoolStats]:
        """(full, swa) device pool stats; lazily kept SWA pages count as cached."""
        return (PoolStats(self._full.capacity, self._full.num_free, self._tree_f - self._locked_f,
                          self._locked_f + self._private_f, self._reserved_f),
                PoolStats(self._swa.capacity, self._swa.num_free, self._tree_s - self._locked_s + self._lazy_s,
                          self._locked_s + self._private_s, self._reserved_s))

    # ------------------------------------------------------------------ transitions

    def grant(self, nf: int, ns: int) -> tuple[array, array]:
        """free -> private: nf full and ns SWA pages for a running sequence (the caller made room)."""
        self._private_f += nf
        self._private_s += ns
        return self._full.alloc(nf), self._swa.alloc(ns)

    def promise(self, full: int, swa: int) -> None:
        """Change what running sequences are promised (admission, growth, pages they no longer need)."""
        self._reserved_f += full
        self._reserved_s += swa

    def free_private(self, full: Sequence[int], swa: Sequence[int]) -> None:
        """private -> free."""
        self._full.free(full)
        self._swa.free(swa)
        self._private_f -= len(full)
        self._private_s -= len(swa)

    def slide_swa(self, freed: Sequence[int], lazy: int, promised: int) -> None:
        """A running sequence's window slid: `freed` private SWA pages -> free, `lazy` more -> lazy, and its
        promise changed by `promised` (one call per commit: this is the decode hot path)."""
        self._swa.free(freed)
        self._private_s -= len(freed) + lazy
        self._lazy_s += lazy
        self._reserved_s += promised

    def to_tree(self, nf: int, ns: int, locked_swa: int = 0) -> None:
        """private -> tree: a finishing sequence's pages become nodes (`locked_swa` of the SWA pages heal
        nodes whose SWA is being read)."""
        self._private_f -= nf
        self._private_s -= ns
        self._tree_f += nf
        self._tree_s += ns
        self._locked_s += locked_swa

    def free_tree(self, full: Sequence[int], swa: Sequence[int]) -> None:
        """tree (unlocked) -> free: eviction."""
        self._full.free(full)
        self._swa.free(swa)
        self._tree_f -= len(full)
        self._tree_s -= len(swa)

    def free_tree_swa(self, swa: Sequence[int]) -> None:
        """tree (unlocked) -> free, SWA pages only: SWA eviction (the node becomes a tombstone)."""
        self._swa.free(swa)
        self._tree_s -= len(swa)

    def load(self, nf: int, ns: int, swa_locked: bool) -> tuple[array, array]:
        """free -> tree, locked: device pages for a node coming back from a lower tier (the caller made room)."""
        self._tree_f += nf
        self._tree_s += ns
        self._locked_f += nf
        if swa_locked:
            self._locked_s += ns
        return self._full.alloc(nf), self._swa.alloc(ns)

    def lock(self, nf: int, ns: int) -> None:
        """Tree pages that became locked (negative: unlocked)."""
        self._locked_f += nf
        self._locked_s += ns

    def from_lazy(self, back: int, freed: Iterable[int] = ()) -> None:
        """lazy -> private (`back` pages) and lazy -> free (`freed`)."""
        freed = list(freed)
        if freed:
            self._swa.free(freed)
        self._lazy_s -= back + len(freed)
        self._private_s += back

    # ------------------------------------------------------------------ audit

    def check_units(self) -> None:
        """Per pool free + cached + in_use == capacity and free + cached >= promised."""
        for name, st in zip(("full", "swa"), self.usage(), strict=True):
            check_pool_stats(name, st)

    def check_invariants(self, tree: Held, seqs: Held) -> None:
        """The counters equal what the tree and the running sequences hold (recomputed by them); per pool free +
        cached + in_use == capacity and free + cached >= promised; every page id is in exactly one place."""
        got = (self._tree_f, self._tree_s, self._locked_f, self._locked_s, self._private_f, self._private_s,
               self._lazy_s)
        want = (len(tree.full), len(tree.swa), tree.locked_full, tree.locked_swa, len(seqs.full), len(seqs.swa),
                len(seqs.lazy_swa))
        if got != want:
            raise AssertionError(f"counters (tree full/swa, locked full/swa, private full/swa, lazy swa) are {got}, "
                                 f"recomputed {want}")
        if (self._reserved_f, self._reserved_s) != (seqs.reserved_full, seqs.reserved_swa):
            raise AssertionError(f"reserved counters {(self._reserved_f, self._reserved_s)} != recomputed "
                                 f"{(seqs.reserved_full, seqs.reserved_swa)}")
        self.check_units()
        check_pool_ids(self._full, tree.full + seqs.full)
        check_pool_ids(self._swa, tree.swa + seqs.swa + seqs.lazy_swa)


class UnitPagePool(PagePool):
    """A group's page-id pool on the arena: handing out a page id also takes that page's `per_page` units from
    the arena's one shared free-unit list and records them (`table[page * per_page + c]` = its c-th unit, in
    chunk order; -1 while the page is free); freeing a page returns them. So the physical layout follows the
    ledger: units in use == what it counts. (Flat int64 arrays: the engine views the table without a copy.)"""

    __slots__ = ("units", "table", "per_page")

    def __init__(self, name: str, capacity: int, per_page: int, units: array) -> None:
        super().__init__(name, capacity)
        self.units = units  # shared with the other group's pool: the arena's free units
        self.per_page = per_page
        self.table = array("q", [-1]) * (capacity * per_page)

    def alloc(self, n: int) -> array:
        pages = super().alloc(n)
        k = n * self.per_page
        if k <= 0:
            return pages
        units, table, pp = self.units, self.table, self.per_page
        if k > len(units):
            super().free(pages)
            raise MemoryError(f"{self.name} pool: need {k} units, {len(units)} free")
        got = units[-k:]
        del units[-k:]
        got.reverse()  # lowest first, like the page ids
        for i, p in enumerate(pages):
            table[p * pp:(p + 1) * pp] = got[i * pp:(i + 1) * pp]
        return pages

    def alloc_one(self) -> int:
        return int(self.alloc(1)[0])

    def free(self, pages: Iterable[int]) -> None:
        pages = pages if isinstance(pages, array) else array("q", pages)
        units, table, pp = self.units, self.table, self.per_page
        none = array("q", [-1]) * pp
        for p in pages:
            units.extend(table[p * pp:(p + 1) * pp])
            table[p * pp:(p + 1) * pp] = none
        super().free(pages)

    def free_one(self, page: int) -> None:
        self.free((page,))

    def page_units(self, page: int) -> tuple[int, ...]:
        return tuple(self.table[page * self.per_page:(page + 1) * self.per_page])


class ArenaLedger(PageLedger):
    """Both groups on one arena of `units`: a full page takes `fu` units, an SWA page `su`, and any free unit
    serves either group (each page id maps to its units in `unit_table`, so there is no fragmentation).

    Page ids stay per group and never run out before units do; the transitions are `PageLedger`'s, only the
    reads (`fits`, `has_free`, `avail_*`) count units. Units free + cached + in use == arena, and promises
    (`reserved`) are held in units, so bytes either group had cached can keep a promise of the other.
    Details: docs/kvcache.md, "One arena".
    """

    __slots__ = ("_units", "_fu", "_su", "_free_units")

    def __init__(self, units: int, fu: int, su: int) -> None:
        super().__init__(0, 0)
        self._free_units = array("q", range(units - 1, -1, -1))  # ascending hand-out order, like PagePool
        self._full = UnitPagePool("full", units // fu, fu, self._free_units)
        self._swa = UnitPagePool("swa", units // su, su, self._free_units)
        self._units, self._fu, self._su = units, fu, su

    def unit_table(self, group: str) -> tuple[array, int]:
        """(table, units per page) of `group`: a flat int64 array, page p's units at [p * per_page, (p + 1) *
        per_page) (-1: p is free). A live page's units only change when it is handed out again; the engine
        views the array (no copy) and translates page tables through it."""
        pool = self._pool(group)
        return pool.table, pool.per_page

    def page_units(self, group: str, page: int) -> tuple[int, ...]:
        """The units device page `page` of `group` holds now."""
        return self._pool(group).page_units(page)

    def _pool(self, group: str) -> UnitPagePool:
        pool = self._full if group == "full" else self._swa
        assert isinstance(pool, UnitPagePool)
        return pool

    def free_units(self) -> int:
        f, s = self._full, self._swa
        return self._units - self._fu * (f.capacity - f.num_free) - self._su * (s.capacity - s.num_free)

    def _cached_units(self) -> int:
        return self._fu * (self._tree_f - self._locked_f) + self._su * (self._tree_s - self._locked_s + self._lazy_s)

    def _reserved_units(self) -> int:
        return self._fu * self._reserved_f + self._su * self._reserved_s

    def avail_units(self) -> int:
        """Units that can be handed out: free + evictable - promised."""
        return self.free_units() + self._cached_units() - self._reserved_units()

    def avail_full(self) -> int:
        return self.avail_units() // self._fu

    def avail_swa(self) -> int:
        return self.avail_units() // self._su

    def fits(self, nf: int, ns: int) -> bool:
        return self._fu * nf + self._su * ns <= self.avail_units()

    def has_free(self, nf: int, ns: int) -> bool:
        return self._fu * nf + self._su * ns <= self.free_units()

    def units_of(self, nf: int, ns: int) -> int:
        return self._fu * nf + self._su * ns

    def free_full(self) -> int:
        return self.free_units() // self._fu

    def free_swa(self) -> int:
        return self.free_units() // self._su

    def spare_free_swa(self) -> int:
        return (self.free_units() - self._reserved_units()) // self._su

    def shortfall(self, need_full: int, need_swa: int) -> tuple[str, int, int, int, int, int] | None:
        """None if the promise fits; else ("arena", need, available, free, evictable, promised)."""
        need = self.units_of(need_full, need_swa)
        avail = self.avail_units()
        if need <= avail:
            return None
        return "arena", need, max(avail, 0), self.free_units(), self._cached_units(), self._reserved_units()

    def usage(self) -> tuple[PoolStats, PoolStats]:
        """Per group: pages in use and cached, and as free the pages of that group the free units would hold
        (so free + cached + in_use == capacity per group, capacity moving with the other group's use)."""
        full, swa = super().usage()
        fr = self.free_units()
        return (PoolStats(full.in_use + full.cached + fr // self._fu, fr // self._fu, full.cached, full.in_use,
                          full.reserved),
                PoolStats(swa.in_use + swa.cached + fr // self._su, fr // self._su, swa.cached, swa.in_use,
                          swa.reserved))

    def arena_stats(self) -> ArenaStats:
        full, swa = super().usage()
        fu, su = self._fu, self._su
        return ArenaStats(self._units, self.free_units(), fu * full.in_use, fu * full.cached, su * swa.in_use,
                          su * swa.cached, self._reserved_units())

    def check_units(self) -> None:
        """Units free + cached + in use == arena and free + cached >= promised (a group's promise may be kept
        with units the other group caches, so there is no per-group bound)."""
        st = self.arena_stats()
        used = st.full_in_use + st.full_cached + st.swa_in_use + st.swa_cached
        if st.free < 0 or st.free + used != st.units:
            raise AssertionError(f"arena: free {st.free} + full/swa in use/cached {used} != {st.units} units")
        if st.free + st.full_cached + st.swa_cached < st.reserved:
            raise AssertionError(f"arena: promised {st.reserved} units but only "
                                 f"{st.free + st.full_cached + st.swa_cached} free or evictable")

    def check_invariants(self, tree: Held, seqs: Held) -> None:
        super().check_invariants(tree, seqs)
        self.check_unit_map()

    def check_unit_map(self) -> None:
        """Every live page holds its units, free pages none; no unit is held by two pages or both held and
        free; units held == what the ledger counts (arena - free units)."""
        check_unit_map("arena", (self._pool("full"), self._pool("swa")), self._free_units, self._units,
                       self._units - self.free_units())


def check_unit_map(name: str, pools: Sequence[UnitPagePool], free_units: array, units: int, counted: int) -> None:
    """An arena's unit map (device or host): every live page of `pools` holds its units, free pages none; the
    units held and `free_units` are exactly 0 .. units - 1 once each, and the units held == `counted` (what the
    arena's books say is in use)."""
    held: list[int] = []
    for pool in pools:
        free = set(pool.free_ids())
        for p in range(pool.capacity):
            got = pool.page_units(p)
            if (p in free) != (got == (-1,) * pool.per_page) or (p not in free and min(got) < 0):
                raise AssertionError(f"{name}: {pool.name} page {p} holds units {got} but is "
                                     f"{'free' if p in free else 'live'}")
            if p not in free:
                held += got
    every = held + list(free_units)
    if len(held) != counted or sorted(every) != list(range(units)):
        raise AssertionError(f"{name}: units held {len(held)} + free {len(free_units)} are not exactly "
                             f"0..{units - 1} once each (the books count {counted} in use)")


def check_pool_stats(name: str, st: PoolStats) -> None:
    if st.free + st.cached + st.in_use != st.capacity:
        raise AssertionError(f"{name} pool: free {st.free} + cached {st.cached} + in_use {st.in_use} != capacity "
                             f"{st.capacity}")
    if st.free + st.cached < st.reserved:
        raise AssertionError(f"{name} pool: promised {st.reserved} pages but only {st.free + st.cached} free or "
                             f"evictable")


def check_pool_ids(pool: PagePool, owned: list[int]) -> None:
    """Pages owned + free are exactly 0 .. capacity - 1 (none lost, none in two places)."""
    ids = owned + pool.free_ids()
    if sorted(ids) != list(range(pool.capacity)):
        dup = [p for p, k in Counter(ids).items() if k > 1]
        raise AssertionError(f"{pool.name} pool: pages owned + free are not exactly 0..{pool.capacity - 1} "
                             f"(duplicates {dup[:5]}, count {len(ids)})")
