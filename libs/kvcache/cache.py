"""The SWA-aware KV cache: a thin front over parts that each own their state (docs/kvcache.md, "Parts").

Engine protocol: match -> admit -> (reserve -> forward -> commit)* -> finish | abort.

    KVCache (front: wiring, the public API, `_make_room`, `check_invariants` composed)
      |-- PageLedger   ledger.py     device pools; free / cached / in-use / reserved counters
      |-- PrefixIndex  index.py      tree, node map, live hits, locks, insert, executes evictions
      |-- Evictor      evictor.py    full-LRU and SWA-LRU heaps (which node goes next)
      |-- Running      running.py    sequence views, promises, the sliding window, the lazy queue
      |-- ReuseStats   retention.py  checkpoint kinds stored / reused, cold kinds, rebuild counts
      |-- LowerTier[]  tiers.py      host tier (L2) pools and copies; GCache (L3) plugs in here
      `-- EventLog     events.py     numbered KVEvents

Accounting (per device pool): free + cached + in_use == capacity, where cached = tree pages nobody locks
(evictable) and in_use = locked tree pages + pages private to running sequences. Admission promises each
running sequence its lifetime growth (`reserved`), and nothing is handed out unless free + cached stays
>= reserved, so an admitted sequence's reserve() of a page-sized chunk or a decode token never fails.
"""

from __future__ import annotations

from collections.abc import Sequence

from libs.kvcache.config import KVCacheConfig
from libs.kvcache.events import EventLog
from libs.kvcache.evictor import Evictor
from libs.kvcache.index import PrefixIndex
from libs.kvcache.ledger import PageLedger
from libs.kvcache.retention import ReuseStats
from libs.kvcache.running import Running
from libs.kvcache.sequence import SeqAllocation
from libs.kvcache.tiers import NO_TIER_USAGE, HostTier, LowerTier
from libs.kvcache.tree import Node, held_blocks
from libs.kvcache.types import (
    AdmitResult,
    CacheSnapshot,
    KVEvent,
    PageCopy,
    PoolUsage,
    PrefixHit,
    RebuildStats,
)


class KVCache:
    def __init__(self, config: KVCacheConfig, audit_tokens: bool = False) -> None:
        """`audit_tokens` (tests): remember each cached page's tokens so `check_invariants` can recompute every
        node's hash chain (the tree itself stores only hashes)."""
        self.cfg = config
        self.stats = ReuseStats()
        self.events = EventLog(config.max_pending_events, config.window_pages)
        self.ledger = PageLedger(config.num_full_pages, config.num_swa_pages)
        self.host = HostTier(config.num_host_full_pages, config.num_host_swa_pages, self.events) if (
            config.num_host_full_pages) else None
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
        return self.index.match(tokens, block_hashes, rebuild)

    def release_hit(self, hit: PrefixHit) -> None:
        """Give back the locks of a hit that will not be admitted."""
        self.index.release_hit(hit)

    def admit(self, seq_id: str, tokens: Sequence[int], hit: PrefixHit, max_new_tokens: int,
              block_hashes: Sequence[int] | None = None) -> AdmitResult:
        """Admit if both pools can hold the prompt plus `max_new_tokens` of decode (after evicting unlocked
        cache). Takes over the hit's locks on success; releases them on failure (match again later).

        `block_hashes`: the prompt's hash chain if the caller already has it (the gateway computes it with the
        same function and seed); the cache then hashes only pages it has not been given."""
        return self.sequences.admit(seq_id, tokens, hit, max_new_tokens, block_hashes)

    # ------------------------------------------------------------------ the running sequence

    def reserve(self, seq_id: str, num_new_tokens: int) -> bool:
        """Allocate pages so the next `num_new_tokens` tokens can be written: full pages up to the new end and
        SWA pages from one window before the current page boundary to the new end. False (state unchanged) if
        both pools cannot provide them even after eviction."""
        return self.sequences.reserve(seq_id, num_new_tokens)

    def commit(self, seq_id: str, num_new_tokens: int, new_token_ids: Sequence[int] = ()) -> None:
        """The KV of the next `num_new_tokens` tokens is written; `new_token_ids` (sampled tokens) are appended.
        SWA pages that left the window are freed here, at once (kept only if a checkpoint needs them)."""
        self.sequences.commit(seq_id, num_new_tokens, new_token_ids)

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
        return self.host.backup(self.index.nodes.values(), max_pages, self.index.lower_copy_dropped)

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
        return PoolUsage(full=full, swa=swa, host_full=host_full, host_swa=host_swa)

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
        ledger, evictor, index, running = self.ledger, self.evictor, self.index, self.sequences
        while ledger.free_full() < nf:
            node = evictor.pop_full()
            if node is None:
                raise AssertionError(f"full pool: need {nf} free pages, accounting promised them, none evictable")
            index.evict_device(node)
        while ledger.free_swa() < ns:
            lazy = running.lazy_key()
            if lazy is not None and (lazy <= evictor.swa_top_key()) and running.reclaim_lazy():
                continue
            node = evictor.pop_swa()
            if node is not None:
                index.evict_swa(node)
            elif not running.reclaim_lazy():
                raise AssertionError(f"swa pool: need {ns} free pages, accounting promised them, none evictable")

    def check_invariants(self) -> None:
        """Each part audits its own state; the ledger checks the pages the tree and the sequences say they hold
        against its counters and free lists. AssertionError naming what is wrong."""
        nodes, tree = self.index.check_invariants(self.sequences.lock_holders())
        self.events.check_invariants(nodes)
        for tier in self.tiers:
            tier.check_invariants(nodes)
        seqs = self.sequences.check_invariants()
        self.ledger.check_invariants(tree, seqs)
        self.evictor.check_invariants()
        self.stats.check_invariants(self.cfg.rebuild_tokens)
