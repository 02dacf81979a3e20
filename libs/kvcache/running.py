"""Running sequences: admission (lifetime promises), reserve / commit (the sliding SWA window, retained and lazily
kept checkpoint pages), finish / abort, and the lazy queue.

It owns the sequence views (`SeqAllocation`) and the lazy queue. Pages change state only through the ledger; at finish
the prefix index takes the pages it keeps (writing -1 into the sequence's page tables) and the rest are freed
here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from libs.kvcache.config import KVCacheConfig
from libs.kvcache.hashing import chain_hashes
from libs.kvcache.index import HitLock, PrefixIndex
from libs.kvcache.ledger import Held, PageLedger
from libs.kvcache.retention import (
    POLICIES,
    SPECULATIVE,
    RetentionContext,
    RetentionPlan,
    ReuseStats,
    kept_pages,
    plan_from,
)
from libs.kvcache.sequence import SeqAllocation
from libs.kvcache.tree import Node, ids, no_pages, path_to_root
from libs.kvcache.types import AdmitResult, PrefixHit

_LazyEntry = tuple[int, int, str]  # (stamp, page index, seq id)


class Running:
    def __init__(self, cfg: KVCacheConfig, ledger: PageLedger, index: PrefixIndex, stats: ReuseStats,
                 make_room: Callable[[int, int], None]) -> None:
        """`make_room(nf, ns)`: evict until both free lists hold that many pages (the front's loop)."""
        self.cfg = cfg
        self.P = cfg.page_size
        self.wp = cfg.window_pages
        self._policy = POLICIES[cfg.retention]
        self._ledger = ledger
        self._index = index
        self._cold = stats.cold
        self._stats = stats
        self._make_room = make_room
        self.seqs: dict[str, SeqAllocation] = {}
        # (stamp, page index, seq id), oldest first: stamps are the clock when the page left its window, so
        # appending keeps the queue sorted (no heap needed). An entry is stale once the index left seq.lazy. Ids,
        # not SeqAllocation objects: a stale entry must not keep a finished sequence (and its token list) alive
        # for the GC.
        self._lazy_q: deque[_LazyEntry] = deque()

    # ------------------------------------------------------------------ admission

    def admit(self, seq_id: str, tokens: Sequence[int], hit: PrefixHit, max_new_tokens: int,
              block_hashes: Sequence[int] | None, swa_from: int = 0) -> AdmitResult:
        """See `KVCache.admit`."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if not tokens or max_new_tokens < 0:
            raise ValueError(f"admit {seq_id!r}: need a non-empty prompt and max_new_tokens >= 0")
        entry = self._index.take_over(hit.hit_id)
        if hit.hit_id and entry is None:
            raise ValueError(f"admit {seq_id!r}: hit {hit.hit_id} is not live (released or admitted already)")
        if hit.full_tokens >= len(tokens) or hit.tokens % self.P or hit.full_tokens % self.P or (
                hit.tokens > hit.full_tokens):
            raise ValueError(f"admit {seq_id!r}: hit of {hit.tokens} tokens (full KV {hit.full_tokens}) does not "
                             f"fit a {len(tokens)}-token prompt")
        if swa_from % self.P:
            raise ValueError(f"admit {seq_id!r}: swa_from={swa_from} is not page aligned")
        seq = self._new_seq(seq_id, list(tokens), hit, entry[0] if entry else None, max_new_tokens, swa_from)
        short = self._ledger.shortfall(seq.full_cap, seq.swa_cap)
        if short is not None:
            if entry:
                self._index.unlock(entry[0], entry[1], swa=entry[2])
            name, need, avail, free, cached, reserved = short
            unit = "units" if name == "arena" else "pages"
            return AdmitResult(False, f"{name} pool cannot hold {seq_id!r}: needs {need} {unit} for {len(tokens)} "
                                      f"prompt + {max_new_tokens} new tokens (hit {seq.num_computed}), available "
                                      f"{avail} = free {free} + evictable {cached} - promised to running sequences "
                                      f"{reserved}", seq.full_cap, seq.swa_cap)
        if hit.full_tokens > hit.tokens:
            self._stats.rebuild_admitted(hit.full_tokens - hit.tokens)
        self._stats.admitted(min(hit.raw_tokens, (len(tokens) - 1) // self.P * self.P), hit.tokens)
        if block_hashes is not None:
            seq.hashes = block_hashes[:len(tokens) // self.P]  # a slice is a copy: the caller may reuse its list
        elif entry is not None:  # the hit path's hashes: insert then hashes only the pages after the hit
            seq.hashes = self._index.path_hashes(entry[0])
        self.seqs[seq_id] = seq
        self._ledger.promise(seq.full_cap, seq.swa_cap)
        return AdmitResult(True, "", seq.full_cap, seq.swa_cap)

    def _new_seq(self, seq_id: str, tokens: list[int], hit: PrefixHit, node: Node | None,
                 max_new: int, swa_from: int) -> SeqAllocation:
        """The sequence view of an admission. Full pages: the hit's tree pages [0, full_tokens), private after.
        SWA pages: its own from `hit.tokens` on (a rebuild hit reads none of the tree's); checkpoints only where
        their whole window is written (from `swa_from` on)."""
        hp = hit.full_tokens // self.P
        sf = hit.tokens // self.P
        ctx = RetentionContext(len(tokens), len(tokens) + max_new, hit.tokens, hit.raw_tokens, self.P,
                               self.cfg.window, self.cfg.align, self.cfg.checkpoint_every_pages)
        plan = self._policy(ctx)
        if sf < hp:  # rebuild: a checkpoint inside the span would hold scratch SWA KV
            plan = plan_from(plan, hit.full_tokens)
        if swa_from > hit.tokens:  # a checkpoint's window's first page must be written: X / page - wp >= swa_from
            plan = plan_from(RetentionPlan(False, plan.checkpoints, plan.kinds), swa_from + self.wp * self.P)
        keep = kept_pages(plan, self.P, self.wp, sf)
        total = -(-(len(tokens) + max_new) // self.P)
        full_cap = total - hp
        # Only the window is promised: checkpoint pages are kept later if memory nobody was promised is left.
        swa_cap = total - sf if plan.keep_all else min(total - sf, self.cfg.seq_swa_pages)
        seq = SeqAllocation(seq_id, tokens, hit.full_tokens, hp, node, full_cap, swa_cap, keep, plan.keep_all,
                  full=ids(hit.full_pages), swa=ids(hit.swa_pages), num_computed=hit.tokens,
                  reserved_upto=hit.tokens, swa_lo=sf, swa_locked=0 < hit.tokens == hit.full_tokens,
                  swa_from=sf, scratch_end=max(sf, hp - self.wp) if sf < hp else sf)
        seq.ckpt_ends = tuple(x // self.P for x in plan.checkpoints)
        seq.ckpt_kinds = {x // self.P: plan.kind_of(i) for i, x in enumerate(plan.checkpoints)}
        for end, kinds in seq.ckpt_kinds.items():
            for j in range(max(sf, end - self.wp), end):
                seq.keep_kinds[j] = seq.keep_kinds.get(j, 0) | kinds
        return seq

    # ------------------------------------------------------------------ reserve / commit

    def reserve(self, seq_id: str, num_new_tokens: int, evict: bool = True) -> bool:
        """See `KVCache.reserve`."""
        seq = self.get(seq_id)
        if num_new_tokens < 0:
            raise ValueError(f"reserve {seq_id!r}: num_new_tokens must be >= 0")
        target = seq.num_computed + num_new_tokens
        if seq.num_computed < seq.hit_tokens:
            return self._reserve_span(seq, target)
        need = -(-target // self.P) - len(seq.full)
        if need <= 0:
            seq.reserved_upto = max(seq.reserved_upto, target)
            return True
        # Every new page is inside the window, so it gets both a full page and an SWA page.
        return self._grant(seq, target, need, (), evict)

    def _reserve_span(self, seq: SeqAllocation, target: int) -> bool:
        """reserve() inside a rebuild span [R, E): the full pages below E are the tree's (never written); SWA
        pages for every page the chunk writes that has none; both past E."""
        end = -(-target // self.P)
        holes = [j for j in range(seq.num_computed // self.P, min(end, len(seq.swa))) if seq.swa[j] < 0]
        return self._grant(seq, target, max(0, end - len(seq.full)), holes)

    def _grant(self, seq: SeqAllocation, target: int, new: int, holes: Sequence[int], evict: bool = True) -> bool:
        """Give seq `new` pages past its end (full + SWA each) and SWA pages at the logical pages `holes`, or
        return False (state unchanged) when the pools cannot provide them even after eviction."""
        ledger = self._ledger
        need_s = len(holes) + new
        if not ledger.fits(max(0, new - seq.full_outstanding()), max(0, need_s - seq.swa_outstanding())):
            return False
        if not ledger.has_free(new, need_s):
            if not evict:
                return False
            self._make_room(new, need_s)
        before_f, before_s = seq.full_outstanding(), seq.swa_outstanding()
        full, swa = ledger.grant(new, need_s)
        if holes:
            for j, s in zip(holes, swa[:len(holes)], strict=True):
                seq.swa[j] = s
            swa = swa[len(holes):]
        seq.full += full
        seq.swa += swa
        seq.swa_private += need_s
        seq.full_cap = max(seq.full_cap, seq.full_private)
        seq.swa_cap = max(seq.swa_cap, seq.swa_private)
        ledger.promise(seq.full_outstanding() - before_f, seq.swa_outstanding() - before_s)
        seq.reserved_upto = max(seq.reserved_upto, target)
        return True

    def commit(self, seq_id: str, num_new_tokens: int, new_token_ids: Sequence[int]) -> None:
        """See `KVCache.commit`."""
        seq = self.get(seq_id)
        n = seq.num_computed + num_new_tokens
        if num_new_tokens < 0 or n > seq.reserved_upto:
            raise ValueError(f"commit {seq_id!r}: {num_new_tokens} tokens exceed the reserved "
                             f"{seq.reserved_upto - seq.num_computed}")
        if n > len(seq.tokens) + len(new_token_ids):
            raise ValueError(f"commit {seq_id!r}: KV for {n} tokens but the sequence has "
                             f"{len(seq.tokens) + len(new_token_ids)}")
        seq.num_computed = n
        seq.tokens.extend(new_token_ids)
        self._slide_window(seq)

    def trim(self, seq_id: str) -> int:
        """See `KVCache.trim`."""
        seq = self.get(seq_id)
        keep = max(-(-seq.num_computed // self.P), seq.hit_pages)
        seq.reserved_upto = max(seq.num_computed, min(seq.reserved_upto, keep * self.P))
        if len(seq.full) <= keep:
            return 0
        # pages past the computed end are private and inside the window (never kept, lazy or the tree's)
        full = seq.full[keep:].tolist()
        swa = [p for p in seq.swa[keep:] if p >= 0]
        before_f, before_s = seq.full_outstanding(), seq.swa_outstanding()
        del seq.full[keep:]
        del seq.swa[keep:]
        seq.swa_private -= len(swa)
        self._ledger.free_private(full, swa)
        # the lifetime promise stands: the freed pages are promised back to the sequence
        self._ledger.promise(seq.full_outstanding() - before_f, seq.swa_outstanding() - before_s)
        return len(full)

    def _slide_window(self, seq: SeqAllocation) -> None:
        first = seq.num_computed // self.P - self.wp  # first page of the window kept at rest
        lo = max(seq.swa_from, first)
        if seq.swa_locked and first >= seq.hit_pages and seq.lock_node is not None:
            self._index.unlock(seq.lock_node, seq.hit_tokens, swa=True, full=False)
            seq.swa_locked = False
            seq.swa[:seq.hit_pages] = no_pages(seq.hit_pages)
        if lo <= seq.swa_lo:
            return
        if seq.swa_lo < seq.scratch_end:
            self._free_scratch(seq, min(lo, seq.scratch_end))
        if seq.keep_all or lo <= seq.swa_lo:
            return
        ledger, cold, arena = self._ledger, self._cold, self.cfg.arena
        before = seq.swa_outstanding()
        spare = ledger.avail_swa()  # frees below do not change it: each freed page is promised back to seq
        spare_free = ledger.spare_free_swa()  # ... the part that evicts nothing
        freed = []
        lazy = 0
        clock = self._index.clock
        for j in range(seq.swa_lo, lo):
            s = seq.swa[j]
            if s < 0:
                continue
            kinds = seq.keep_kinds.get(j, 0) if j in seq.keep else 0
            if kinds and (cold(kinds) or arena) and (kinds & ~SPECULATIVE or spare_free > 0):
                # A cold kind's page is kept lazily: it becomes cached memory, reclaimed in SWA LRU order
                # with the tree's cold checkpoints (before any warm one), so it never crowds out a promise
                # or warm KV. Speculative pages (periodic: many per sequence, never reused yet) only take
                # memory that is free now; measured on the trace, letting them push out cached cold
                # checkpoints cost hits.
                if not kinds & ~SPECULATIVE:
                    spare_free -= 1
                seq.lazy.add(j)
                self._lazy_q.append((clock, j, seq.seq_id))
                lazy += 1
                continue
            if kinds and not cold(kinds) and spare > 0:
                # Keep the warm checkpoint page and promise one more page so the window can still grow;
                # best effort, from memory no running sequence was promised (it may evict cache).
                seq.swa_cap += 1
                spare -= 1
                continue
            freed.append(s)
            seq.swa[j] = -1
        seq.swa_private -= len(freed) + lazy
        ledger.slide_swa(freed, lazy, seq.swa_outstanding() - before)
        seq.swa_lo = lo

    def _free_scratch(self, seq: SeqAllocation, upto: int) -> None:
        """Free a rebuild span's scratch SWA pages below `upto` (they left the window, or the sequence ends):
        never retained, whatever the policy says."""
        lo = seq.swa_lo
        freed = [s for s in seq.swa[lo:upto] if s >= 0]
        seq.swa[lo:upto] = no_pages(upto - lo)
        before = seq.swa_outstanding()
        seq.swa_private -= len(freed)
        if seq.keep_all:  # its promise covered every page; these are never needed again
            seq.swa_cap -= len(freed)
        self._ledger.slide_swa(freed, 0, seq.swa_outstanding() - before)
        seq.swa_lo = upto

    # ------------------------------------------------------------------ finish

    def finish(self, seq_id: str, cache: bool) -> None:
        """See `KVCache.finish`."""
        seq = self.get(seq_id)
        del self.seqs[seq_id]
        if seq.swa_lo < seq.scratch_end:
            self._free_scratch(seq, seq.scratch_end)
        self._settle_lazy(seq, keep=cache)
        tree_upto = self._index.insert(seq) if cache and self.cfg.enable_prefix_cache else seq.hit_pages
        self._drop_seq(seq, tree_upto)

    def _settle_lazy(self, seq: SeqAllocation, keep: bool) -> None:
        """At finish: the lazy pages that still form a whole checkpoint window go back to the sequence (to be
        inserted with it); the others (a window the cache took a page of, or everything on abort) are freed."""
        if not seq.lazy:
            return
        whole: set[int] = set()
        if keep and not seq.lazy_taken:  # the usual case, nothing taken back: insert them all (cheap)
            whole = seq.lazy
        elif keep:
            for end in seq.ckpt_ends:
                pages = range(max(seq.swa_from, end - self.wp), min(end, len(seq.swa)))
                if pages and all(seq.swa[j] >= 0 for j in pages):
                    whole.update(j for j in pages if j in seq.lazy)
        freed: list[int] = []
        if whole is not seq.lazy:
            drop = [j for j in seq.lazy if j not in whole]
            freed = [seq.swa[j] for j in drop]
            for j in drop:
                seq.swa[j] = -1
        before = seq.swa_outstanding()
        seq.swa_private += len(whole)
        self._ledger.from_lazy(len(whole), freed)
        self._ledger.promise(0, seq.swa_outstanding() - before)
        seq.lazy = set()
        if len(self._lazy_q) > 4 * self._ledger.lazy_swa() + 256:  # stale entries pile up while nothing is reclaimed
            self._lazy_q = deque(e for e in self._lazy_q if self._lazy_seq(e) is not None)

    def _drop_seq(self, seq: SeqAllocation, tree_upto: int) -> None:
        """Free the sequence's private pages; those below `tree_upto` are the tree's (all -1 here)."""
        self._ledger.promise(-seq.full_outstanding(), -seq.swa_outstanding())
        full = [p for p in seq.full[tree_upto:] if p >= 0]
        # A rebuild's SWA pages start below its tree pages (those not inserted are still its own)
        swa = [p for p in seq.swa[tree_upto if seq.swa_from == seq.hit_pages else seq.swa_from:] if p >= 0]
        self._ledger.free_private(full, swa)
        if seq.lock_node is not None:
            self._index.unlock(seq.lock_node, seq.hit_tokens, swa=seq.swa_locked)

    def get(self, seq_id: str) -> SeqAllocation:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not running")
        return seq

    # ------------------------------------------------------------------ lazy pages (reclaimable cache)

    def reclaim_lazy(self) -> bool:
        """Free the oldest lazy checkpoint page and the rest of its window (useless without it)."""
        while self._lazy_q:
            entry = self._lazy_q.popleft()
            seq = self._lazy_seq(entry)
            if seq is None:
                continue
            j = entry[1]
            pages = {j}
            for end in seq.ckpt_ends:
                if end - self.wp <= j < end:
                    pages.update(k for k in range(end - self.wp, end) if k in seq.lazy)
            seq.lazy_taken = True
            freed = []
            for k in pages:
                freed.append(seq.swa[k])
                seq.swa[k] = -1
                seq.lazy.discard(k)
            self._ledger.from_lazy(0, freed)
            return True
        return False

    def lazy_head(self) -> tuple[int, int]:
        """(checkpoint kinds, logical page) of the oldest live lazy page (call after `lazy_key`)."""
        stamp, j, sid = self._lazy_q[0]
        return self.seqs[sid].keep_kinds.get(j, 0), j

    def lazy_key(self) -> int | None:
        """SWA LRU key of the oldest live lazy page (a cold checkpoint's key: its stamp), None if none."""
        q = self._lazy_q
        while q and self._lazy_seq(q[0]) is None:
            q.popleft()
        return q[0][0] if q else None

    def _lazy_seq(self, entry: _LazyEntry) -> SeqAllocation | None:
        """The running sequence whose lazy page the entry names, None if stale. (A reused sequence id can revive
        an entry: its page is then reclaimed a little early, never wrongly: it is lazy either way.)"""
        seq = self.seqs.get(entry[2])
        return seq if seq is not None and entry[1] in seq.lazy else None

    # ------------------------------------------------------------------ audit

    def lock_holders(self) -> list[HitLock]:
        return [(s.lock_node, s.hit_tokens, s.swa_locked) for s in self.seqs.values() if s.lock_node is not None]

    def check_invariants(self) -> Held:
        """Every sequence's page tables, window, rebuild span and lazy pages; returns the device pages the
        sequences hold and what they are promised (for the ledger's audit)."""
        held = Held()
        for s in self.seqs.values():
            held.full += [p for p in s.full[s.hit_pages:] if p >= 0]
            held.swa += [p for j, p in enumerate(s.swa) if p >= 0 and j >= s.swa_from and j not in s.lazy]
            held.lazy_swa += [s.swa[j] for j in s.lazy]
            held.reserved_full += s.full_outstanding()
            held.reserved_swa += s.swa_outstanding()
            self._check_seq(s)
        stamps = [t for t, _, _ in self._lazy_q]
        if stamps != sorted(stamps):
            _fail("lazy queue is not oldest first (reclaim order would not be LRU)")
        return held

    def _check_seq(self, s: SeqAllocation) -> None:
        P, wp = self.P, self.wp
        where = f"sequence {s.seq_id!r}"
        if len(s.full) != len(s.swa) or len(s.full) * P < s.reserved_upto:
            _fail(f"{where}: page tables cover {len(s.full)} pages for {s.reserved_upto} reserved tokens")
        if not s.swa_from * P <= s.num_computed <= min(s.reserved_upto, len(s.tokens)):
            _fail(f"{where}: num_computed {s.num_computed} outside [hit, reserved/tokens]")
        if any(p < 0 for p in s.full):
            _fail(f"{where}: a page without a full page")
        self._check_rebuild(s, where)
        self._check_lazy(s, where)
        if s.keep_all:
            return
        window = [j for j in range(s.swa_from, len(s.swa)) if s.swa[j] >= 0 and j not in s.keep]
        first = max(s.swa_from, s.num_computed // P - wp)
        if any(j < first for j in window):
            _fail(f"{where}: SWA page(s) {[j for j in window if j < first]} left the window but were not freed")
        resting = -(-s.num_computed // P) - first
        bound = -(-s.reserved_upto // P) - first if s.reserved_upto > s.num_computed else resting
        if len(window) > max(bound, 0) or (s.reserved_upto == s.num_computed and len(window) > self.cfg.seq_swa_pages):
            _fail(f"{where}: holds {len(window)} window SWA pages, bound is {min(bound, self.cfg.seq_swa_pages)} "
                  f"(window + page = {self.cfg.seq_swa_pages})")
        if s.lock_node is not None:
            path = list(reversed(path_to_root(s.lock_node)))
            if [p for n in path for p in n.full] != s.full[:s.hit_pages].tolist():  # type: ignore[union-attr]
                _fail(f"{where}: hit pages differ from the locked tree path")
            if [h for n in path for h in n.hashes] != chain_hashes(s.tokens, P, self.cfg.hash_seed, 0, s.hit_pages):
                _fail(f"{where}: the locked tree path's block hashes are not the hashes of its prompt")

    def _check_rebuild(self, s: SeqAllocation, where: str) -> None:
        """A rebuild sequence (SWA from R below its tree pages [0, E)) reads no tree SWA (no SWA lock), holds no
        SWA page below R, and keeps none of its scratch pages (below one window before E) past the window."""
        sf, hp, scratch = s.swa_from, s.hit_pages, s.scratch_end
        if sf == hp:
            if scratch != sf:
                _fail(f"{where}: scratch end {scratch} on a sequence without a rebuild span")
            return
        if not sf < scratch <= hp or scratch != max(sf, hp - self.wp) or s.swa_locked:
            _fail(f"{where}: rebuild span pages {sf}..{hp} with scratch end {scratch}, swa_locked {s.swa_locked}")
        if any(p >= 0 for p in s.swa[:sf]):
            _fail(f"{where}: holds SWA pages below its rebuild start page {sf}")
        kept = [j for j in s.keep | s.lazy if j < scratch]
        if kept:
            _fail(f"{where}: retains scratch SWA pages {sorted(kept)} of its rebuild span (below page {scratch})")
        want = max(hp, -(-s.reserved_upto // self.P))
        if len(s.full) != want:
            _fail(f"{where}: {len(s.full)} full pages, want the tree's {hp} then up to the reserved end: {want}")

    def _check_lazy(self, s: SeqAllocation, where: str) -> None:
        """Lazy pages are cold checkpoint pages that left the window, each reclaimable through the lazy queue."""
        first = s.num_computed // self.P - self.wp
        for j in s.lazy:
            if j not in s.keep or j >= first or j < s.swa_from or s.swa[j] < 0:
                _fail(f"{where}: lazy SWA page index {j} is not a kept checkpoint page below the window {first}")
        queued = {j for _, j, sid in self._lazy_q if sid == s.seq_id}
        if not s.lazy <= queued:
            _fail(f"{where}: lazy pages {sorted(s.lazy - queued)} cannot be reclaimed (not in the lazy queue)")


def _fail(msg: str) -> None:
    raise AssertionError(msg)
