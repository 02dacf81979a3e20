"""The SWA-aware KV cache: a thin front over parts that each own their state (docs/kvcache.md, "Parts").

Engine protocol: match -> admit -> (reserve -> forward -> commit)* -> finish | abort.

    KVCache (front: wiring, the public API, `_make_room`, `check_invariants` composed)
      |-- PageLedger   ledger.py     device pools; free / cached / in-use / reserved counters
      |-- PrefixIndex  index.py      tree, node map, live hits, locks, insert, executes evictions
      |-- Evictor      evictor.py    full-LRU and SWA-LRU heaps (which node goes next)
      |-- Running      running.py    sequence views, promises, the sliding window, the lazy queue
      |-- ReuseStats   retention.py  checkpoint kinds stored / reused, cold kinds, rebuild counts
      |-- LowerTier[]  tiers.py      host tier (L2) pools and copies (L3 imports land in its pages)
      `-- EventLog     events.py     numbered KVEvents

Promise: per device pool free + cached + in_use == capacity, and admission reserves each running sequence's
lifetime growth, so an admitted sequence's `reserve()` never fails.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from libs.kvcache.config import KVCacheConfig
from libs.kvcache.events import EventLog
from libs.kvcache.evictor import Evictor
from libs.kvcache.index import PrefixIndex
from libs.kvcache.ledger import ArenaLedger, PageLedger
from libs.kvcache.retention import ReuseStats
from libs.kvcache.running import Running
from libs.kvcache.sequence import SeqAllocation
from libs.kvcache.tiers import NO_TIER_USAGE, HostTier, LowerTier
from libs.kvcache.tree import Node, held_blocks
from libs.kvcache.types import (
    AdmitResult,
    CacheSnapshot,
    CacheStats,
    HostImport,
    KVEvent,
    PageCopy,
    PoolUsage,
    PrefixHit,
    RebuildStats,
)

EVICTION_REASONS = ("full", "swa", "swa_leaf", "lazy", "tombstone_pruned")


class KVCache:
    def __init__(self, config: KVCacheConfig, audit_tokens: bool = False) -> None:
        """`audit_tokens` (tests): remember each cached page's tokens so `check_invariants` can recompute every
        node's hash chain (the tree itself stores only hashes)."""
        self.cfg = config
        self.stats = ReuseStats(censor=config.arena)
        self.events = EventLog(config.max_pending_events, config.window_pages)
        self.arena = ArenaLedger(config.arena_units, config.full_page_units, config.swa_page_units) if (
            config.arena) else None
        self.ledger: PageLedger = self.arena or PageLedger(config.num_full_pages, config.num_swa_pages)
        self._evictions: dict[str, list[int]] = {r: [0, 0] for r in EVICTION_REASONS}  # reason -> victims, freed
        self.host = HostTier(config.num_host_full_pages, config.num_host_swa_pages, self.events,
                             units=config.host_arena_units, fu=config.full_page_units, su=config.swa_page_units,
                             clock=lambda: self.index.clock) if config.has_host else None
        self.tiers: tuple[LowerTier, ...] = (self.host,) if self.host is not None else ()
        nodes: dict[int, Node] = {}
        self.evictor = Evictor(nodes, self.stats.cold)
        self.index = PrefixIndex(config, nodes, self.ledger, self.evictor, self.events, self.stats, self.tiers,
                                 self._make_room, audit_tokens)
        self.sequences = Running(config, self.ledger, self.index, self.stats, self._make_room)
        self._seqs: dict[str, SeqAllocation] = self.sequences.seqs  # the running sequences (read by the tests)

    @property
    def root(self) -> Node:
        """The prefix tree's root (tests walk it as a brute-force reference)."""
        return self.index.root

    # ------------------------------------------------------------------ match / admission

    def match(self, tokens: Sequence[int], block_hashes: Sequence[int] | None = None, *,
              rebuild: bool = True) -> PrefixHit:
        """Longest valid page-aligned hit (< len(tokens)); its nodes stay locked until admit or release_hit.

        `block_hashes`: the prompt's hash chain if the caller has it (same function and seed as the cache);
        otherwise the cache hashes the pages the walk reaches (one page when nothing matches).
        `rebuild=False`: never a rebuild hit (a caller that receives the KV instead of computing it, e.g. a
        disaggregated decode worker, must not have its tree's full pages written)."""
        hit = self.index.match(tokens, block_hashes, rebuild)
        if self.arena is not None and hit.load_copies:
            hit = dataclasses.replace(hit, load_copies=tuple(self._with_units(hit.load_copies, "dst")))
        return hit

    def cached_pages(self, tokens: Sequence[int], block_hashes: Sequence[int] | None = None) -> int:
        """Leading pages of `tokens` whose full KV is cached (device or host tier); changes nothing."""
        return self.index.cached_pages(tokens, block_hashes)

    def import_blocks(self, tokens: Sequence[int], block_hashes: Sequence[int] | None, first: int,
                      end: int) -> HostImport | None:
        """Import the blocks [e, end) of `tokens` (fetched from GCache, L3, from page `first` on) into the host tier
        as a host-only tree node, e = the pages cached now; the full pages of every block and the SWA checkpoint
        window ending at `end` are held. The caller writes the bytes into the host pages returned before the
        next cache call; then match, the valid-hit rule and the layer-by-layer load-back serve them like any L2
        copy. None (no host tier, the tree changed so the import no longer fits, the window reaches below e, no
        host room): nothing imported."""
        if self.host is None:
            return None
        return self.index.import_blocks(tokens, block_hashes, first, end, self.host)

    def release_hit(self, hit: PrefixHit) -> None:
        """Give back the locks of a hit that will not be admitted."""
        self.index.release_hit(hit)

    def admit(self, seq_id: str, tokens: Sequence[int], hit: PrefixHit, max_new_tokens: int,
              block_hashes: Sequence[int] | None = None, swa_from: int = 0) -> AdmitResult:
        """Admit if both pools can hold the prompt plus `max_new_tokens` of decode (after evicting unlocked
        cache). Takes over the hit's locks on success; releases them on failure (match again later).

        `block_hashes`: the prompt's hash chain if the caller already has it (the gateway computes it with the
        same function and seed); the cache then hashes only pages it has not been given.
        `swa_from` (page aligned): SWA KV of the prompt below this token is never written (a disaggregated
        decode worker receives the last window only), so no checkpoint whose window reaches below it is kept."""
        return self.sequences.admit(seq_id, tokens, hit, max_new_tokens, block_hashes, swa_from)

    # ------------------------------------------------------------------ the running sequence

    def reserve(self, seq_id: str, num_new_tokens: int, evict: bool = True) -> bool:
        """Allocate pages so the next `num_new_tokens` tokens can be written: full pages up to the new end and
        SWA pages from one window before the current page boundary to the new end. False (state unchanged) if
        both pools cannot provide them even after eviction. `evict=False`: only from free pages (speculative
        decoding's draft positions, which must not cost cached prefixes)."""
        return self.sequences.reserve(seq_id, num_new_tokens, evict)

    def commit(self, seq_id: str, num_new_tokens: int, new_token_ids: Sequence[int] = ()) -> None:
        """The KV of the next `num_new_tokens` tokens is written; `new_token_ids` (sampled tokens) are appended.
        SWA pages that left the window are freed here, at once (kept only if a checkpoint needs them)."""
        self.sequences.commit(seq_id, num_new_tokens, new_token_ids)

    def trim(self, seq_id: str) -> int:
        """Roll back a reservation past the computed tokens (speculative decoding's rejected drafts): the pages
        after the one holding the last computed token go back to the free lists, both pools, and the sequence
        keeps its admission promise for them. The window was never slid past `num_computed`, so it stands as if
        those positions had never been written. Returns the full pages freed."""
        return self.sequences.trim(seq_id)

    def page_tables(self, seq_id: str) -> tuple[list[int], list[int]]:
        """Per logical page j: the full page id, and the SWA page id or -1 (no SWA KV held for that page)."""
        seq = self.sequences.get(seq_id)
        return seq.full.tolist(), seq.swa.tolist()

    def num_computed(self, seq_id: str) -> int:
        return self.sequences.get(seq_id).num_computed

    def running(self) -> list[str]:
        return list(self._seqs)

    def finish(self, seq_id: str, cache: bool = True) -> None:
        """Insert the page-aligned computed tokens into the tree (healing tombstones), unlock, free the rest."""
        self.sequences.finish(seq_id, cache)

    def abort(self, seq_id: str) -> None:
        """Free everything the sequence held; insert nothing."""
        self.sequences.finish(seq_id, cache=False)

    # ------------------------------------------------------------------ lower tiers, events, stats

    def backup_to_host(self, max_pages: int) -> list[PageCopy]:
        """Back up cold device nodes (full pages plus live SWA pages) to the host tier, coldest first. Returns
        the device->host copies; run them before the next call that may evict the source pages."""
        if self.host is None:
            return []
        copies = self.host.backup(self.index.nodes.values(), max_pages, self.index.lower_copy_dropped)
        return self._with_units(copies, "src") if self.arena is not None else copies

    def _with_units(self, copies: Iterable[PageCopy], side: str) -> list[PageCopy]:
        """The copies with the units their device page (`side`) holds now (one arena; see `PageCopy.units`)."""
        arena = self.arena
        assert arena is not None
        return [dataclasses.replace(c, units=arena.page_units(c.group, getattr(c, side))) for c in copies]

    def drain_events(self) -> list[KVEvent]:
        """The pending events, oldest first (ids consecutive unless the bounded queue dropped some)."""
        return self.events.drain()

    def pending_events(self) -> int:
        """Events queued and not drained yet (O(1): a publisher's "anything to send?")."""
        return self.events.pending()

    def snapshot(self) -> tuple[list[KVEvent], CacheSnapshot]:
        """(the pending events, drained, then the whole cached block set consistent with the last event id
        issued). Publish the events first: with everything drained before, every event <= the snapshot's
        `last_event_id` has then been handed out (or dropped by the bounded queue, which the snapshot covers),
        and the events after it follow as usual. O(cached blocks)."""
        pending = self.events.drain()
        hashes, states = held_blocks(self.index.root)
        return pending, CacheSnapshot(self.events.last_id, hashes, states)

    def usage(self) -> PoolUsage:
        full, swa = self.ledger.usage()
        host_full, host_swa = self.host.usage() if self.host is not None else NO_TIER_USAGE
        return PoolUsage(full=full, swa=swa, host_full=host_full, host_swa=host_swa,
                         arena=self.arena.arena_stats() if self.arena is not None else None,
                         host_arena=self.host.arena_stats() if self.host is not None else None)

    def cache_stats(self) -> CacheStats:
        """Evictions by reason (victims, units freed with an arena, pages without; "tombstone_pruned": device
        full pages that left the tree because their SWA KV had gone), and the hit tokens admitted requests
        lost to missing SWA KV (full-KV match - valid hit)."""
        ev = {r: (v[0], v[1]) for r, v in self._evictions.items()}
        ev["tombstone_pruned"] = (0, self.index.pruned_full_pages)
        return CacheStats(ev, self.stats.raw_hit_tokens, self.stats.valid_hit_tokens)

    def rebuild_stats(self) -> RebuildStats:
        """SWA window rebuild hits returned by match, admitted, and the tokens the admitted ones recompute."""
        return self.stats.rebuild_stats()

    def checkpoint_stats(self) -> dict[str, tuple[int, int, bool]]:
        """Per checkpoint kind: (checkpoints stored, of which reused by a hit, cold), counts halved now and then
        so they follow the workload. Cold kinds' SWA KV is evicted first and kept only from free memory."""
        return self.stats.checkpoint_stats()

    # ------------------------------------------------------------------ the one loop across parts

    def _make_room(self, nf: int, ns: int) -> None:
        """Evict until the free lists hold nf full and ns SWA pages (the ledger promised they can). Tree victims
        come from the evictor; running sequences' lazy pages compete with the tree's SWA in one LRU order."""
        if self.arena is not None:
            self._make_room_arena(nf, ns)
            return
        ledger, evictor, index, running, ev = self.ledger, self.evictor, self.index, self.sequences, self._evictions
        while ledger.free_full() < nf:
            node = evictor.pop_full()
            if node is None:
                raise AssertionError(f"full pool: need {nf} free pages, accounting promised them, none evictable")
            _count(ev["full"], node.npages + node.n_swa)
            index.evict_device(node)
        while ledger.free_swa() < ns:
            lazy = running.lazy_key()
            if lazy is not None and (lazy <= evictor.swa_top_key()) and running.reclaim_lazy():
                _count(ev["lazy"], 1)
                continue
            node = evictor.pop_swa()
            if node is not None:
                n_swa, npages = node.n_swa, node.npages
                left = index.evict_swa(node)
                _count(ev["swa_leaf" if left else "swa"], n_swa + (npages if left else 0))
            elif not running.reclaim_lazy():
                raise AssertionError(f"swa pool: need {ns} free pages, accounting promised them, none evictable")
            else:
                _count(ev["lazy"], 1)

    def _make_room_arena(self, nf: int, ns: int) -> None:
        """One arena: evict, cheapest first, until the free units hold the pages. Three candidates: the full-LRU
        leaf (drops its full KV and checkpoint), the next SWA victim (a checkpoint; the node keeps its full KV
        as a tombstone, or leaves if it is a leaf nothing can use) and the oldest lazy page. Each is scored by
        the recompute it saves per unit it holds, times the chance it is used again: tokens a hit would skip,
        scaled by the checkpoint kind's learned reuse ratio, over (units x LRU age)."""
        arena, evictor, index, running, ev = self.arena, self.evictor, self.index, self.sequences, self._evictions
        assert arena is not None
        need = arena.units_of(nf, ns)
        P, S, fu, su = self.cfg.page_size, self.cfg.rebuild_tokens, self.cfg.full_page_units, self.cfg.swa_page_units
        weight = self.stats.weight
        while arena.free_units() < need:
            clock = index.clock + 1
            best: tuple[float, int, Node | None] = (math.inf, -1, None)
            leaf = evictor.peek_full()
            if leaf is not None:
                units = fu * leaf.npages + su * leaf.n_swa
                # Not scaled by its checkpoint's kind: a leaf's full KV also serves a rebuild hit or the prefix of a
                # longer prompt whose own checkpoint is elsewhere. A tombstone leaf (kept for rebuilds) saves what a
                # rebuild at its end skips.
                saved = leaf.npages * P if not leaf.is_tombstone() else max(0, min(leaf.npages * P, leaf.end * P - S))
                best = (saved / (units * (clock - leaf.access)), 0, leaf)
            node = evictor.peek_swa()
            lazy = running.lazy_key()
            if lazy is not None and (node is None or lazy <= evictor.swa_key(node)):
                # a checkpoint page of a running sequence (taking it drops its window): it saves the prefix up
                # to it (at most S with rebuilds), at its kind's weight
                kinds, j = running.lazy_head()
                saved = (j + 1) * P if not S else min((j + 1) * P, S)
                score = weight(kinds) * saved / (su * self.cfg.window_pages * (clock - lazy))
                if score < best[0]:
                    best = (score, 2, None)
            elif node is not None:
                prunes = not node.children and node.lock == 0 and not node.host_swa_count() and (
                    not index.keeps_tombstone(node))
                units = su * node.n_swa + (fu * node.npages if prunes else 0)
                saved = _gap(node) * P
                if S and not prunes and node.end * P > S:
                    saved = min(saved, S)  # a rebuild at its end recovers all but S tokens
                score = saved * weight(node.kinds) / (units * (clock - node.swa_access))
                if score < best[0]:
                    best = (score, 1, node)
            kind, victim = best[1], best[2]
            if kind == 0:
                assert victim is not None
                _count(ev["full"], fu * victim.npages + su * victim.n_swa)
                index.evict_device(victim)
            elif kind == 1:
                assert victim is not None
                units, npages = su * victim.n_swa, victim.npages
                left = index.evict_swa(victim)
                _count(ev["swa_leaf" if left else "swa"], units + (fu * npages if left else 0))
            elif kind == 2 and running.reclaim_lazy():
                _count(ev["lazy"], su)
            else:
                raise AssertionError(f"arena: need {need} free units, accounting promised them, none evictable")

    def check_invariants(self) -> None:
        """Each part audits its own state; the ledger checks the pages the tree and the sequences say they hold
        against its counters and free lists. AssertionError naming what is wrong."""
        nodes, tree = self.index.check_invariants(self.sequences.lock_holders())
        self.events.check_invariants(nodes)
        for tier in self.tiers:
            tier.check_invariants(nodes)
        seqs = self.sequences.check_invariants()
        self.ledger.check_invariants(tree, seqs)  # with an arena: units free + cached + in use == arena
        self.evictor.check_invariants()
        self.stats.check_invariants(self.cfg.rebuild_tokens)


def _gap(node: Node) -> int:
    """Pages from the nearest ancestor holding SWA KV (a checkpoint a hit could fall back to) to `node`'s end:
    what a hit ending at `node` loses when its checkpoint goes."""
    start, p = node.start, node.parent
    while p is not None and p.parent is not None and not (p.n_swa or p.host_swa_count()):
        start, p = p.start, p.parent
    return node.end - start


def _count(slot: list[int], freed: int) -> None:
    slot[0] += 1
    slot[1] += freed
