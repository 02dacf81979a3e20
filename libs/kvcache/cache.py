"""The SWA-aware KV cache: dual page pools, sequence views, the prefix tree, eviction, retention, host tier.

Engine protocol: match -> admit -> (reserve -> forward -> commit)* -> finish | abort.

Accounting (per device pool): free + cached + in_use == capacity, where cached = tree pages nobody locks
(evictable) and in_use = locked tree pages + pages private to running sequences. Admission promises each
running sequence its lifetime growth (`reserved`), and nothing is handed out unless free + cached stays
>= reserved, so an admitted sequence's reserve() of a page-sized chunk or a decode token never fails.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from itertools import count

from libs.kvcache.config import KVCacheConfig
from libs.kvcache.pool import PagePool
from libs.kvcache.retention import POLICIES, CheckpointKind, RetentionContext, RetentionPlan, kept_pages
from libs.kvcache.sequence import Seq
from libs.kvcache.tree import (
    Node,
    PromptHashes,
    common_pages,
    ids,
    live,
    make_root,
    no_pages,
    path_to_root,
    split,
    walk,
)
from libs.kvcache.types import (
    AdmitResult,
    EventKind,
    Group,
    KVEvent,
    PageCopy,
    PoolStats,
    PoolUsage,
    PrefixHit,
    RebuildStats,
    Tier,
)

_HeapEntry = tuple[int, int, int, Node]
_LazyEntry = tuple[int, int, str]  # (stamp, page index, seq id)
_PendingEvent = tuple[int, EventKind, Tier, tuple[int, ...], "int | None", "int | tuple[bool, ...]",
                      "int | tuple[bool, ...]"]
_KIND_BITS = tuple(int(k) for k in CheckpointKind)
_ALL_KINDS = sum(_KIND_BITS)
_BITS_OF = tuple(tuple(b for b in _KIND_BITS if m & b) for m in range(_ALL_KINDS + 1))  # kinds -> its bits
_SPECULATIVE = int(CheckpointKind.PERIODIC)  # cold until proven reused: inserted at low priority, they only
# take SWA memory no warm checkpoint needs
_END = int(CheckpointKind.END)
_REUSED = 1 << 30  # node.kinds flag: a hit has ended at this checkpoint
_WARM = 1 << 48  # added to the SWA LRU key of checkpoints of kinds that get reused: they go after cold ones
_COLD_EVIDENCE = 32  # checkpoints of a kind stored before its hit ratio can call it cold
_COLD_FRACTION = 0.1  # a kind is cold when its hit ratio is below this fraction of the best kind's
_COLD_RECHECK = 8  # counted checkpoints / reuses between re-evaluations of the cold kinds
_STATS_HALF_LIFE = 1024  # stored checkpoints of a kind after which its counts are halved (follow the workload)
_NO_HIT = PrefixHit(0, 0, 0)


class KVCache:
    def __init__(self, config: KVCacheConfig, audit_tokens: bool = False) -> None:
        """`audit_tokens` (tests): remember each cached page's tokens so `check_invariants` can recompute every
        node's hash chain (the tree itself stores only hashes)."""
        self.cfg = config
        self._audit: dict[int, tuple[int, ...]] | None = {} if audit_tokens else None
        self.P = config.page_size
        self.wp = config.window_pages
        self.full_pool = PagePool("full", config.num_full_pages)
        self.swa_pool = PagePool("swa", config.num_swa_pages)
        self.host_full_pool = PagePool("host_full", config.num_host_full_pages)
        self.host_swa_pool = PagePool("host_swa", config.num_host_swa_pages)
        self._policy = POLICIES[config.retention]
        self.root = make_root()
        self._nodes: dict[int, Node] = {}
        self._seqs: dict[str, Seq] = {}
        # hit id -> (deepest node, L or E, holds SWA locks) while the hit holds its locks
        self._hits: dict[int, tuple[Node, int, bool]] = {}
        self._hit_ids = count(1)
        self._clock = 0
        self._tree_full = self._tree_swa = 0  # device pages owned by tree nodes
        self._locked_full = self._locked_swa = 0  # ... of which locked (lock > 0 / swa_lock > 0)
        self._private_full = self._private_swa = 0  # pages owned by running sequences
        self._reserved_full = self._reserved_swa = 0  # promised, not yet allocated
        self._lazy_swa = 0  # running sequences' lazily kept checkpoint pages (cached: reclaimable at any time)
        # (stamp, page index, seq id), oldest first: stamps are the clock when the page left its window, so
        # appending keeps the queue sorted (no heap needed). An entry is stale once the index left seq.lazy. Ids,
        # not Seq objects: a stale entry must not keep a finished sequence (and its token list) alive for the GC.
        self._lazy_q: deque[_LazyEntry] = deque()
        self._full_heap: list[_HeapEntry] = []
        self._swa_heap: list[_HeapEntry] = []
        # (id, kind, tier, hashes, parent hash, flags as `_flags_spec`): built into KVEvents when drained
        self._events: deque[_PendingEvent] = deque(maxlen=config.max_pending_events)
        self._next_event = 0
        self._kind_stored = dict.fromkeys(_KIND_BITS, 0)
        self._kind_hits = dict.fromkeys(_KIND_BITS, 0)
        self._cold_kinds = self._cold_mask()  # CheckpointKind bits this workload does not reuse (at first:
        # the speculative kinds)
        self._kind_counts = 0
        self._rebuild_matched = self._rebuild_admitted = self._rebuilt_tokens = 0

    # ------------------------------------------------------------------ match / hits

    def match(self, tokens: Sequence[int], block_hashes: Sequence[int] | None = None, *,
              rebuild: bool = True) -> PrefixHit:
        """Longest valid page-aligned hit (< len(tokens)); its nodes stay locked until admit or release_hit.

        `block_hashes`: the prompt's hash chain if the caller has it (same function and seed as the cache);
        otherwise the cache hashes the pages the walk reaches (one page when nothing matches).
        `rebuild=False`: never a rebuild hit (a caller that receives the KV instead of computing it, e.g. a
        disaggregated decode worker, must not have its tree's full pages written)."""
        if not self.cfg.enable_prefix_cache or len(tokens) <= self.P or not self.root.children or (
                block_hashes and block_hashes[0] not in self.root.children):  # no-reuse fast path
            return _NO_HIT
        path = walk(self.root, PromptHashes(tokens, self.P, self.cfg.hash_seed, block_hashes), len(tokens) // self.P)
        if not path:
            return _NO_HIT
        raw = sum(m for _, m in path) * self.P
        max_pages = (len(tokens) - 1) // self.P
        best_dev, best_any = self._best_valid(path, max_pages)
        self._clock += 1
        hit = self._rebuild_hit(path, raw, max_pages, best_any) if rebuild and self.cfg.rebuild_tokens else None
        if hit is None and best_any > best_dev:
            hit = self._take_hit(path, best_any, raw)
        if hit is None and best_dev:
            hit = self._take_hit(path, best_dev, raw)
        return hit or PrefixHit(0, raw, 0)

    def release_hit(self, hit: PrefixHit) -> None:
        """Give back the locks of a hit that will not be admitted."""
        entry = self._hits.pop(hit.hit_id, None)
        if entry is None:
            if hit.hit_id:
                raise KeyError(f"hit {hit.hit_id} is not live (already released or admitted)")
            return
        self._unlock(entry[0], entry[1], swa=entry[2])

    def _best_valid(self, path: list[tuple[Node, int]], max_pages: int) -> tuple[int, int]:
        """(longest valid L on device, longest valid L counting host-only nodes), in tokens."""
        run = g = best_dev = best_any = 0
        on_device = True
        wp = self.wp
        for node, m in path:
            if node.full is None:
                on_device = False
                swa = node.host_swa
            else:
                swa = node.swa
            for i in range(m):
                if g >= max_pages:
                    return best_dev * self.P, best_any * self.P
                run = run + 1 if swa is not None and swa[i] >= 0 else 0
                g += 1
                if run >= (g if g < wp else wp):
                    best_any = g
                    if on_device:
                        best_dev = g
        return best_dev * self.P, best_any * self.P

    def _rebuild_hit(self, path: list[tuple[Node, int]], raw: int, max_pages: int, best: int) -> PrefixHit | None:
        """A rebuild hit at the end E of the full-KV match (host nodes loaded; else the device part alone), only
        when it skips more than the best valid hit: R = E - rebuild_tokens > best."""
        P, S = self.P, self.cfg.rebuild_tokens
        on_device = 0
        for node, m in path:
            if node.full is None:
                break
            on_device += m
        for end in dict.fromkeys((min(raw // P, max_pages), min(on_device, max_pages))):
            if end * P - S > best:
                hit = self._take_hit(path, end * P, raw, end * P - S)
                if hit is not None:
                    return hit
        return None

    def _take_hit(self, path: list[tuple[Node, int]], hit_len: int, raw: int, skip: int = -1) -> PrefixHit | None:
        """Split the tree so the hit and its window end at node boundaries, lock it, load host-only nodes.

        `skip` < hit_len makes a rebuild hit: full KV of [0, hit_len) locked, no SWA KV read (no SWA locks, no
        SWA recency refresh, not a reuse of the checkpoint kinds there), the engine starts at `skip`."""
        end = hit_len // self.P
        rebuild = 0 <= skip < hit_len
        ws = end if rebuild else max(0, end - self.wp)  # no node starts at or past `end`: nothing SWA-locked
        deepest = self._split_at(path[-1][0], end)
        self._split_chain_at(deepest, ws)
        chain = path_to_root(deepest)  # deepest first
        lock_f = sum(len(n.full) for n in chain if n.lock == 0 and n.full is not None)
        lock_s = sum(n.n_swa for n in chain if n.start >= ws and n.swa_lock == 0)
        loads = [n for n in reversed(chain) if n.full is None]
        load_f = sum(n.npages for n in loads)
        load_s = sum(n.host_swa_count() for n in loads)
        if lock_f + load_f > self._avail_full() or lock_s + load_s > self._avail_swa():
            return None
        self._lock(deepest, ws)
        copies = self._load(loads, load_f, load_s)
        for n in chain:
            n.access = self._clock
            if n.start >= ws:
                n.swa_access = self._clock
        hid = next(self._hit_ids)
        self._hits[hid] = (deepest, hit_len, not rebuild)
        if rebuild:
            self._rebuild_matched += 1
        elif not deepest.kinds & _REUSED:  # the hit ratio of a kind: the share of its checkpoints ever reused
            self._count_kinds(self._kind_hits, deepest.kinds)
            deepest.kinds |= _REUSED
        full_pages: list[int] = []
        swa_pages: list[int] = []
        for n in reversed(chain):
            full_pages += n.full  # type: ignore[arg-type]
            swa_pages += n.swa if n.start >= ws else no_pages(n.npages)  # type: ignore[arg-type]
        return PrefixHit(skip if rebuild else hit_len, raw, load_f * self.P, tuple(full_pages),
                         tuple(swa_pages), tuple(copies), hid, hit_len)

    def _split_at(self, last: Node, end: int) -> Node:
        """Split so a node on `last`'s chain ends exactly at page `end` (node starts survive earlier splits,
        path lists do not); returns that node."""
        node = last
        while node.start >= end:
            node = node.parent  # type: ignore[assignment]
        assert node.parent is not None and end <= node.end, f"hit end page {end} beyond the matched path"
        return node if node.end == end else self._split(node, end - node.start)

    def _split_chain_at(self, deepest: Node, page: int) -> None:
        node = deepest
        while node.parent is not None and node.start > page:
            node = node.parent
        if node.parent is not None and node.start < page < node.end:
            self._split(node, page - node.start)

    def _split(self, node: Node, k: int) -> Node:
        head = split(node, k)
        self._nodes[head.nid] = head
        if head.n_swa:
            self._push(self._swa_heap, head, self._swa_key(head))
        return head

    def _load(self, loads: list[Node], nf: int, ns: int) -> list[PageCopy]:
        """Give host-only nodes (already locked) device pages; the copies are for the engine to run."""
        if not loads:
            return []
        self._ensure_free(nf, ns)
        copies = []
        for n in loads:
            n.full = ids(self.full_pool.alloc(n.npages))
            n.swa = no_pages(n.npages)
            copies += [PageCopy(Group.FULL, h, d, "h2d") for h, d in zip(n.host_full, n.full, strict=True)]  # type: ignore[arg-type]
            for i, h in enumerate(n.host_swa):  # type: ignore[arg-type]
                if h >= 0:
                    n.swa[i] = self.swa_pool.alloc_one()
                    copies.append(PageCopy(Group.SWA, h, n.swa[i], "h2d"))
            n.n_swa = n.host_swa_count()
            self._tree_full += n.npages
            self._tree_swa += n.n_swa
            self._locked_full += n.npages
            if n.swa_lock:
                self._locked_swa += n.n_swa
            self._emit(EventKind.STORED, Tier.DEVICE, n)
        return copies

    # ------------------------------------------------------------------ locks

    def _lock(self, deepest: Node, ws: int) -> None:
        for n in path_to_root(deepest):
            if n.lock == 0 and n.full is not None:
                self._locked_full += len(n.full)
            n.lock += 1
            if n.start >= ws:
                if n.swa_lock == 0:
                    self._locked_swa += n.n_swa
                n.swa_lock += 1

    def _unlock(self, deepest: Node, hit_len: int, swa: bool, full: bool = True) -> None:
        ws = max(0, hit_len // self.P - self.wp)
        chain = path_to_root(deepest)
        if swa:
            for n in chain:
                if n.start < ws:
                    break
                n.swa_lock -= 1
                if n.swa_lock == 0:
                    self._locked_swa -= n.n_swa
                    self._push(self._swa_heap, n, self._swa_key(n))
        if not full:
            return
        for n in chain:
            n.lock -= 1
            if n.lock == 0:
                if n.full is not None:
                    self._locked_full -= len(n.full)
                self._push(self._full_heap, n, self._full_key(n))
        self._prune_tombstones(deepest)

    # ------------------------------------------------------------------ admission and the running sequence

    def admit(self, seq_id: str, tokens: Sequence[int], hit: PrefixHit, max_new_tokens: int,
              block_hashes: Sequence[int] | None = None) -> AdmitResult:
        """Admit if both pools can hold the prompt plus `max_new_tokens` of decode (after evicting unlocked
        cache). Takes over the hit's locks on success; releases them on failure (match again later).

        `block_hashes`: the prompt's hash chain if the caller already has it (the gateway computes it with the
        same function and seed); the cache then hashes only pages it has not been given."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if not tokens or max_new_tokens < 0:
            raise ValueError(f"admit {seq_id!r}: need a non-empty prompt and max_new_tokens >= 0")
        entry = self._hits.pop(hit.hit_id, None)
        if hit.hit_id and entry is None:
            raise ValueError(f"admit {seq_id!r}: hit {hit.hit_id} is not live (released or admitted already)")
        if hit.full_tokens >= len(tokens) or hit.tokens % self.P or hit.full_tokens % self.P or (
                hit.tokens > hit.full_tokens):
            raise ValueError(f"admit {seq_id!r}: hit of {hit.tokens} tokens (full KV {hit.full_tokens}) does not "
                             f"fit a {len(tokens)}-token prompt")
        seq = self._new_seq(seq_id, list(tokens), hit, entry[0] if entry else None, max_new_tokens)
        reason = self._admission_shortfall(seq, len(tokens), max_new_tokens)
        if reason:
            if entry:
                self._unlock(entry[0], entry[1], swa=entry[2])
            return AdmitResult(False, reason, seq.full_cap, seq.swa_cap)
        if hit.full_tokens > hit.tokens:
            self._rebuild_admitted += 1
            self._rebuilt_tokens += hit.full_tokens - hit.tokens
        if block_hashes is not None:
            seq.hashes = block_hashes[:len(tokens) // self.P]  # a slice is a copy: the caller may reuse its list
        elif entry is not None:  # the hit path's hashes: insert then hashes only the pages after the hit
            seq.hashes = [h for n in reversed(path_to_root(entry[0])) for h in n.hashes]  # type: ignore[misc]
        self._seqs[seq_id] = seq
        self._reserved_full += seq.full_cap
        self._reserved_swa += seq.swa_cap
        return AdmitResult(True, "", seq.full_cap, seq.swa_cap)

    def _new_seq(self, seq_id: str, tokens: list[int], hit: PrefixHit, node: Node | None, max_new: int) -> Seq:
        """The sequence view of an admission. Full pages: the hit's tree pages [0, full_tokens), private after.
        SWA pages: its own from `hit.tokens` on (a rebuild hit reads none of the tree's)."""
        hp = hit.full_tokens // self.P
        sf = hit.tokens // self.P
        ctx = RetentionContext(len(tokens), len(tokens) + max_new, hit.tokens, hit.raw_tokens, self.P,
                               self.cfg.window, self.cfg.align, self.cfg.checkpoint_every_pages)
        plan = self._policy(ctx)
        if sf < hp:  # rebuild: a checkpoint inside the span would hold scratch SWA KV
            plan = _from(plan, hit.full_tokens)
        keep = kept_pages(plan, self.P, self.wp, sf)
        total = -(-(len(tokens) + max_new) // self.P)
        full_cap = total - hp
        # Only the window is promised: checkpoint pages are kept later if memory nobody was promised is left.
        swa_cap = total - sf if plan.keep_all else min(total - sf, self.cfg.seq_swa_pages)
        seq = Seq(seq_id, tokens, hit.full_tokens, hp, node, full_cap, swa_cap, keep, plan.keep_all,
                  full=ids(hit.full_pages), swa=ids(hit.swa_pages), num_computed=hit.tokens,
                  reserved_upto=hit.tokens, swa_lo=sf, swa_locked=0 < hit.tokens == hit.full_tokens,
                  swa_from=sf, scratch_end=max(sf, hp - self.wp) if sf < hp else sf)
        seq.ckpt_ends = tuple(x // self.P for x in plan.checkpoints)
        seq.ckpt_kinds = {x // self.P: plan.kind_of(i) for i, x in enumerate(plan.checkpoints)}
        for end, kinds in seq.ckpt_kinds.items():
            for j in range(max(sf, end - self.wp), end):
                seq.keep_kinds[j] = seq.keep_kinds.get(j, 0) | kinds
        return seq

    def _admission_shortfall(self, seq: Seq, prompt: int, max_new: int) -> str:
        for name, need, avail, free, cached, reserved in (
                ("full", seq.full_cap, self._avail_full(), self.full_pool.num_free,
                 self._tree_full - self._locked_full, self._reserved_full),
                ("swa", seq.swa_cap, self._avail_swa(), self.swa_pool.num_free,
                 self._tree_swa - self._locked_swa, self._reserved_swa)):
            if need > avail:
                return (f"{name} pool cannot hold {seq.seq_id!r}: needs {need} pages for {prompt} prompt + {max_new} "
                        f"new tokens (hit {seq.num_computed}), available {max(avail, 0)} = free {free} + evictable "
                        f"{cached} - promised to running sequences {reserved}")
        return ""

    def reserve(self, seq_id: str, num_new_tokens: int) -> bool:
        """Allocate pages so the next `num_new_tokens` tokens can be written: full pages up to the new end and
        SWA pages from one window before the current page boundary to the new end. False (state unchanged) if
        both pools cannot provide them even after eviction."""
        seq = self._seq(seq_id)
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
        return self._grant(seq, target, need, ())

    def _reserve_span(self, seq: Seq, target: int) -> bool:
        """reserve() inside a rebuild span [R, E): the full pages below E are the tree's (never written); SWA
        pages for every page the chunk writes that has none; both past E."""
        end = -(-target // self.P)
        holes = [j for j in range(seq.num_computed // self.P, min(end, len(seq.swa))) if seq.swa[j] < 0]
        return self._grant(seq, target, max(0, end - len(seq.full)), holes)

    def _grant(self, seq: Seq, target: int, new: int, holes: Sequence[int]) -> bool:
        """Give seq `new` pages past its end (full + SWA each) and SWA pages at the logical pages `holes`, or
        return False (state unchanged) when the pools cannot provide them even after eviction."""
        need_s = len(holes) + new
        if new - seq.full_outstanding() > self._avail_full() or need_s - seq.swa_outstanding() > self._avail_swa():
            return False
        self._ensure_free(new, need_s)
        before_f, before_s = seq.full_outstanding(), seq.swa_outstanding()
        for j in holes:
            seq.swa[j] = self.swa_pool.alloc_one()
        seq.full += self.full_pool.alloc(new)
        seq.swa += self.swa_pool.alloc(new)
        seq.swa_private += need_s
        seq.full_cap = max(seq.full_cap, seq.full_private)
        seq.swa_cap = max(seq.swa_cap, seq.swa_private)
        self._private_full += new
        self._private_swa += need_s
        self._reserved_full += seq.full_outstanding() - before_f
        self._reserved_swa += seq.swa_outstanding() - before_s
        seq.reserved_upto = max(seq.reserved_upto, target)
        return True

    def commit(self, seq_id: str, num_new_tokens: int, new_token_ids: Sequence[int] = ()) -> None:
        """The KV of the next `num_new_tokens` tokens is written; `new_token_ids` (sampled tokens) are appended.
        SWA pages that left the window are freed here, at once (kept only if a checkpoint needs them)."""
        seq = self._seq(seq_id)
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

    def _slide_window(self, seq: Seq) -> None:
        first = seq.num_computed // self.P - self.wp  # first page of the window kept at rest
        lo = max(seq.swa_from, first)
        if seq.swa_locked and first >= seq.hit_pages and seq.lock_node is not None:
            self._unlock(seq.lock_node, seq.hit_tokens, swa=True, full=False)
            seq.swa_locked = False
            seq.swa[:seq.hit_pages] = no_pages(seq.hit_pages)
        if lo <= seq.swa_lo:
            return
        if seq.swa_lo < seq.scratch_end:
            self._free_scratch(seq, min(lo, seq.scratch_end))
        if seq.keep_all or lo <= seq.swa_lo:
            return
        before = seq.swa_outstanding()
        spare = self._avail_swa()  # frees below do not change it: each freed page is promised back to seq
        spare_free = self.swa_pool.num_free - self._reserved_swa  # ... the part that evicts nothing
        freed = []
        lazy = 0
        for j in range(seq.swa_lo, lo):
            s = seq.swa[j]
            if s < 0:
                continue
            kinds = seq.keep_kinds.get(j, 0) if j in seq.keep else 0
            if kinds and self._cold(kinds) and (kinds & ~_SPECULATIVE or spare_free > 0):
                # A cold kind's page is kept lazily: it becomes cached memory, reclaimed in SWA LRU order
                # with the tree's cold checkpoints (before any warm one), so it never crowds out a promise
                # or warm KV. Speculative pages (periodic: many per sequence, never reused yet) only take
                # memory that is free now; measured on the trace, letting them push out cached cold
                # checkpoints cost hits.
                if not kinds & ~_SPECULATIVE:
                    spare_free -= 1
                seq.lazy.add(j)
                self._lazy_q.append((self._clock, j, seq.seq_id))
                lazy += 1
                continue
            if kinds and not self._cold(kinds) and spare > 0:
                # Keep the warm checkpoint page and promise one more page so the window can still grow;
                # best effort, from memory no running sequence was promised (it may evict cache).
                seq.swa_cap += 1
                spare -= 1
                continue
            freed.append(s)
            seq.swa[j] = -1
        self.swa_pool.free(freed)
        seq.swa_private -= len(freed) + lazy
        self._private_swa -= len(freed) + lazy
        self._lazy_swa += lazy
        self._reserved_swa += seq.swa_outstanding() - before
        seq.swa_lo = lo

    def _free_scratch(self, seq: Seq, upto: int) -> None:
        """Free a rebuild span's scratch SWA pages below `upto` (they left the window, or the sequence ends):
        never retained, whatever the policy says."""
        lo = seq.swa_lo
        freed = [s for s in seq.swa[lo:upto] if s >= 0]
        seq.swa[lo:upto] = no_pages(upto - lo)
        before = seq.swa_outstanding()
        seq.swa_private -= len(freed)
        if seq.keep_all:  # its promise covered every page; these are never needed again
            seq.swa_cap -= len(freed)
        self.swa_pool.free(freed)
        self._private_swa -= len(freed)
        self._reserved_swa += seq.swa_outstanding() - before
        seq.swa_lo = upto

    def page_tables(self, seq_id: str) -> tuple[list[int], list[int]]:
        """Per logical page j: the full page id, and the SWA page id or -1 (no SWA KV held for that page)."""
        seq = self._seq(seq_id)
        return seq.full.tolist(), seq.swa.tolist()

    def num_computed(self, seq_id: str) -> int:
        return self._seq(seq_id).num_computed

    def running(self) -> list[str]:
        return list(self._seqs)

    def finish(self, seq_id: str, cache: bool = True) -> None:
        """Insert the page-aligned computed tokens into the tree (healing tombstones), unlock, free the rest."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        if seq.swa_lo < seq.scratch_end:
            self._free_scratch(seq, seq.scratch_end)
        self._settle_lazy(seq, keep=cache)
        tree_upto = self._insert(seq) if cache and self.cfg.enable_prefix_cache else seq.hit_pages
        self._drop_seq(seq, tree_upto)

    def abort(self, seq_id: str) -> None:
        """Free everything the sequence held; insert nothing."""
        self.finish(seq_id, cache=False)

    def _settle_lazy(self, seq: Seq, keep: bool) -> None:
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
        if whole is not seq.lazy:
            drop = [j for j in seq.lazy if j not in whole]
            self.swa_pool.free(seq.swa[j] for j in drop)
            for j in drop:
                seq.swa[j] = -1
        before = seq.swa_outstanding()
        seq.swa_private += len(whole)
        self._private_swa += len(whole)
        self._reserved_swa += seq.swa_outstanding() - before
        self._lazy_swa -= len(seq.lazy)
        seq.lazy = set()
        if len(self._lazy_q) > 4 * self._lazy_swa + 256:  # stale entries pile up while nothing is reclaimed
            self._lazy_q = deque(e for e in self._lazy_q if self._lazy_seq(e) is not None)

    def _reclaim_lazy(self) -> bool:
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
            for k in pages:
                self.swa_pool.free_one(seq.swa[k])
                seq.swa[k] = -1
                seq.lazy.discard(k)
            self._lazy_swa -= len(pages)
            return True
        return False

    def _lazy_key(self) -> int | None:
        """SWA LRU key of the oldest live lazy page (a cold checkpoint's key: its stamp), None if none."""
        q = self._lazy_q
        while q and self._lazy_seq(q[0]) is None:
            q.popleft()
        return q[0][0] if q else None

    def _lazy_seq(self, entry: _LazyEntry) -> Seq | None:
        """The running sequence whose lazy page the entry names, None if stale. (A reused sequence id can revive
        an entry: its page is then reclaimed a little early, never wrongly: it is lazy either way.)"""
        seq = self._seqs.get(entry[2])
        return seq if seq is not None and entry[1] in seq.lazy else None

    def _drop_seq(self, seq: Seq, tree_upto: int) -> None:
        """Free the sequence's private pages; those below `tree_upto` are the tree's (all -1 here)."""
        self._reserved_full -= seq.full_outstanding()
        self._reserved_swa -= seq.swa_outstanding()
        full = [p for p in seq.full[tree_upto:] if p >= 0]
        # A rebuild's SWA pages start below its tree pages (those not inserted are still its own)
        swa = [p for p in seq.swa[tree_upto if seq.swa_from == seq.hit_pages else seq.swa_from:] if p >= 0]
        self.full_pool.free(full)
        self.swa_pool.free(swa)
        self._private_full -= len(full)
        self._private_swa -= len(swa)
        if seq.lock_node is not None:
            self._unlock(seq.lock_node, seq.hit_tokens, swa=seq.swa_locked)

    def _seq(self, seq_id: str) -> Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} is not running")
        return seq

    # ------------------------------------------------------------------ insert

    def _insert(self, seq: Seq) -> int:
        """Hand pages [hit_pages, computed pages) to the tree (or free them as duplicates); returns the end."""
        npg = seq.num_computed // self.P
        if npg <= seq.swa_from:
            return seq.hit_pages
        self._clock += 1
        hashes = PromptHashes(seq.tokens, self.P, self.cfg.hash_seed, seq.hashes)
        node, pos = self.root, 0
        while pos < npg and node.children:
            child = node.children.get(hashes.upto(pos + 1)[pos])
            if child is None:
                break
            m = common_pages(child, hashes, pos, npg - pos)
            if m < child.npages:
                child = self._split(child, m)
            self._absorb(child, seq, pos)
            child.access = self._clock
            pos, node = pos + child.npages, child
        if pos < npg:
            self._add_nodes(node, seq, pos, npg, hashes.upto(npg))
        return max(npg, seq.hit_pages)

    def _absorb(self, node: Node, seq: Seq, pos: int) -> None:
        """The sequence recomputed pages the tree already has: drop duplicates, heal tombstones, fill host-only
        nodes back onto the device with the sequence's pages. (A rebuild's SWA pages below its tree pages heal
        the tombstones its hit started from; its full pages there are the tree's own.)"""
        if node.end <= seq.swa_from:
            return
        if node.full is None:
            self._adopt(node, seq, pos)
            return
        healed = 0
        dup_full, dup_swa = [], []
        own_full = seq.hit_pages - pos
        for i in range(max(0, seq.swa_from - pos), node.npages):
            g = pos + i
            if i >= own_full:
                dup_full.append(seq.full[g])
                seq.full[g] = -1
            s = seq.swa[g]
            if s < 0:
                continue
            seq.swa[g] = -1
            if node.swa[i] < 0:  # type: ignore[index]
                node.swa[i] = s  # type: ignore[index]
                healed += 1
            else:
                dup_swa.append(s)
        self.full_pool.free(dup_full)
        self.swa_pool.free(dup_swa)
        self._private_full -= len(dup_full)
        self._private_swa -= len(dup_swa) + healed
        if healed:
            node.n_swa += healed
            self._tree_swa += healed
            if node.swa_lock:
                self._locked_swa += healed
            node.swa_access = self._clock
            self._set_kinds(node, seq)
            self._push(self._swa_heap, node, self._swa_key(node))
            self._emit(EventKind.STORED, Tier.DEVICE, node)

    def _adopt(self, node: Node, seq: Seq, pos: int) -> None:
        n = node.npages
        node.full = ids(seq.full[pos:pos + n])
        node.swa = ids(seq.swa[pos:pos + n])
        seq.full[pos:pos + n] = no_pages(n)
        seq.swa[pos:pos + n] = no_pages(n)
        node.n_swa = len(node.swa) - node.swa.count(-1)
        self._tree_full += n
        self._tree_swa += node.n_swa
        self._private_full -= n
        self._private_swa -= node.n_swa
        node.swa_access = self._clock
        self._set_kinds(node, seq)
        self._push(self._full_heap, node, self._full_key(node))
        self._push(self._swa_heap, node, self._swa_key(node))
        self._emit(EventKind.STORED, Tier.DEVICE, node)

    def _add_nodes(self, parent: Node, seq: Seq, pos: int, npg: int, hashes: Sequence[int]) -> None:
        """New nodes for pages [pos, npg), cut at checkpoint ends so each checkpoint ends a node (SWA eviction
        and locking then work on whole checkpoints)."""
        cuts = sorted({e for e in seq.ckpt_ends if pos < e < npg} | {npg})
        if self._audit is not None:
            P = self.P
            self._audit.update((hashes[j], tuple(seq.tokens[j * P:(j + 1) * P])) for j in range(pos, npg))
        first, n_swa = pos, 0
        for end in cuts:
            node = Node(pos, parent, seq.full[pos:end], seq.swa[pos:end], hashes[pos:end], self._clock)
            parent.children[node.hashes[0]] = node
            self._nodes[node.nid] = node
            if node.n_swa:
                n_swa += node.n_swa
                self._set_kinds(node, seq)
                self._push(self._swa_heap, node, self._swa_key(node))
            self._emit(EventKind.STORED, Tier.DEVICE, node)
            parent, pos = node, end
        # The tree owns the pages now (counted once per insert, not per node).
        seq.full[first:npg] = seq.swa[first:npg] = no_pages(npg - first)
        self._tree_full += npg - first
        self._private_full -= npg - first
        self._tree_swa += n_swa
        self._private_swa -= n_swa
        self._push(self._full_heap, parent, self._full_key(parent))

    # ------------------------------------------------------------------ checkpoint kinds (learned SWA value)

    def _set_kinds(self, node: Node, seq: Seq) -> None:
        """A node that now holds SWA pages of `seq` learns the kinds of the checkpoint ending at its end."""
        if not node.n_swa:
            return
        kinds: int = seq.ckpt_kinds.get(node.end, 0)
        if node.end == seq.num_computed // self.P:
            kinds |= _END
        new = kinds & ~node.kinds
        node.kinds |= kinds
        self._count_kinds(self._kind_stored, new)

    def _count_kinds(self, counts: dict[int, int], kinds: int) -> None:
        if not kinds:
            return
        for bit in _BITS_OF[kinds & _ALL_KINDS]:
            counts[bit] += 1
            if self._kind_stored[bit] >= _STATS_HALF_LIFE:
                self._kind_stored[bit] //= 2
                self._kind_hits[bit] //= 2
        self._kind_counts += 1
        if self._kind_counts % _COLD_RECHECK:
            return
        cold = self._cold_mask()
        if cold != self._cold_kinds:
            self._cold_kinds = cold
            self._rebuild(self._swa_heap)

    def rebuild_stats(self) -> RebuildStats:
        """SWA window rebuild hits returned by match, admitted, and the tokens the admitted ones recompute."""
        return RebuildStats(self._rebuild_matched, self._rebuild_admitted, self._rebuilt_tokens)

    def checkpoint_stats(self) -> dict[str, tuple[int, int, bool]]:
        """Per checkpoint kind: (checkpoints stored, of which reused by a hit, cold), counts halved now and then
        so they follow the workload. Cold kinds' SWA KV is evicted first and kept only from free memory."""
        return {CheckpointKind(b).name.lower(): (self._kind_stored[b], self._kind_hits[b],  # type: ignore[union-attr]
                                                 bool(self._cold_kinds & b)) for b in _KIND_BITS}

    def _cold_mask(self) -> int:
        """Kinds whose checkpoints end hits far less often than the best kind's (Laplace-smoothed ratios);
        before enough evidence, the speculative kinds."""
        hits, stored = self._kind_hits, self._kind_stored
        ratio = [(hits[b] + 1) / (stored[b] + 2) for b in _KIND_BITS]
        bar = _COLD_FRACTION * max(ratio)
        cold = 0
        for b, r in zip(_KIND_BITS, ratio, strict=True):
            if (r < bar) if stored[b] >= _COLD_EVIDENCE else b & _SPECULATIVE:
                cold |= b
        return cold

    def _cold(self, kinds: int) -> bool:
        """Every kind of a checkpoint is cold. No known kind (inside a hit's window, `all` retention) is warm."""
        kinds &= ~_REUSED
        return bool(kinds) and not kinds & ~self._cold_kinds

    def _swa_key(self, n: Node) -> int:
        """SWA LRU order: cold checkpoints first, then the rest, each by recency."""
        return n.swa_access if self._cold(n.kinds) else n.swa_access + _WARM

    @staticmethod
    def _full_key(n: Node) -> int:
        """Full LRU order over leaves. (A cold-first order here measured no gain: the SWA LRU already drops a
        cold leaf's checkpoint first, and the tombstone leaf then leaves the tree with its full pages.)"""
        return n.access

    # ------------------------------------------------------------------ eviction

    def _avail_full(self) -> int:
        return self.full_pool.num_free + self._tree_full - self._locked_full - self._reserved_full

    def _avail_swa(self) -> int:
        return self.swa_pool.num_free + self._tree_swa - self._locked_swa + self._lazy_swa - self._reserved_swa

    def _ensure_free(self, nf: int, ns: int) -> None:
        while self.full_pool.num_free < nf:
            if not self._evict_one(self._full_heap, _full_evictable, self._full_key, self._evict_device):
                raise AssertionError(f"full pool: need {nf} free pages, accounting promised them, none evictable")
        while self.swa_pool.num_free < ns:
            lazy = self._lazy_key()
            if lazy is not None and (lazy <= self._swa_top_key()) and self._reclaim_lazy():
                continue
            if not self._evict_one(self._swa_heap, _swa_evictable, self._swa_key, self._evict_swa) and not (
                    self._reclaim_lazy()):
                raise AssertionError(f"swa pool: need {ns} free pages, accounting promised them, none evictable")

    def _swa_top_key(self) -> float:
        """The SWA LRU key of the next tree victim (stale heap entries at the top fixed first), inf if none."""
        heap = self._swa_heap
        while heap:
            acc, _, _, node = heap[0]
            if not _swa_evictable(node):
                heapq.heappop(heap)
            elif self._swa_key(node) != acc:
                heapq.heapreplace(heap, (self._swa_key(node), -node.start, node.nid, node))
            else:
                return acc
        return math.inf

    def _evict_one(self, heap: list[_HeapEntry], ok: Callable[[Node], bool], key: Callable[[Node], int],
                   evict: Callable[[Node], None]) -> bool:
        """Pop the least recently used evictable node. Entries are lazy: stale ones are skipped or re-pushed
        with the node's current access time; if the heap runs dry it is rebuilt from all nodes once."""
        for attempt in range(2):
            while heap:
                acc, _, _, node = heapq.heappop(heap)
                if not ok(node):
                    continue
                if key(node) != acc:
                    heapq.heappush(heap, (key(node), -node.start, node.nid, node))
                    continue
                evict(node)
                return True
            if attempt == 0:
                self._rebuild(heap)
        return False

    def _push(self, heap: list[_HeapEntry], node: Node, acc: int) -> None:
        if node.parent is None:
            return
        heapq.heappush(heap, (acc, -node.start, node.nid, node))
        if len(heap) > 4 * len(self._nodes) + 256:
            self._rebuild(heap)

    def _rebuild(self, heap: list[_HeapEntry]) -> None:
        ok = _full_evictable if heap is self._full_heap else _swa_evictable
        key = self._full_key if heap is self._full_heap else self._swa_key
        heap[:] = [(key(n), -n.start, n.nid, n) for n in self._nodes.values() if ok(n)]
        heapq.heapify(heap)

    def _evict_device(self, node: Node) -> None:
        """Full-LRU victim (an unlocked device leaf): to host-only if backed up, else out of the tree."""
        parent = node.parent
        if node.host_full is not None and (node.children or node.host_swa_count()):
            self._free_device_pages(node)
            self._emit(EventKind.REMOVED, Tier.DEVICE, node)
        else:
            self._remove_subtree(node)
        self._prune_tombstones(parent)  # type: ignore[arg-type]

    def _evict_swa(self, node: Node) -> None:
        """SWA-LRU victim: drop the node's SWA pages (a tombstone); a tombstone leaf leaves the tree."""
        self.swa_pool.free(live(node.swa, node.n_swa))  # type: ignore[arg-type]
        self._tree_swa -= node.n_swa
        node.swa = no_pages(node.npages)
        node.n_swa = 0
        if node.children or node.lock or not node.is_tombstone():  # the blocks stay: say their SWA went
            self._emit(EventKind.SWA_REMOVED, Tier.DEVICE, node)
        self._prune_tombstones(node)  # else the node leaves now and REMOVED says it all

    def _free_device_pages(self, node: Node) -> None:
        self.full_pool.free(node.full)  # type: ignore[arg-type]
        self.swa_pool.free(live(node.swa, node.n_swa))  # type: ignore[arg-type]
        self._tree_full -= node.npages
        self._tree_swa -= node.n_swa
        node.full = node.swa = None
        node.n_swa = 0

    def _remove_subtree(self, node: Node) -> None:
        assert node.lock == 0, "removing a locked node"
        for child in list(node.children.values()):
            self._remove_subtree(child)
        if node.full is not None:
            self._emit(EventKind.REMOVED, Tier.DEVICE, node)
            self._free_device_pages(node)
        if node.host_full is not None:
            self._emit(EventKind.REMOVED, Tier.HOST, node)
            self._free_host_pages(node)
        del node.parent.children[node.hashes[0]]  # type: ignore[union-attr]
        del self._nodes[node.nid]
        node.alive = False

    def _prune_tombstones(self, node: Node) -> None:
        """Remove unlocked tombstone leaves upward from `node`; note a parent that became a device leaf."""
        while node.parent is not None:
            parent = node.parent
            if not node.children and node.lock == 0 and node.is_tombstone():
                self._remove_subtree(node)
            elif node.full is not None and node.lock == 0 and not node.has_device_child():
                self._push(self._full_heap, node, self._full_key(node))
                return
            else:
                return
            node = parent

    # ------------------------------------------------------------------ host tier

    def backup_to_host(self, max_pages: int) -> list[PageCopy]:
        """Back up cold device nodes (full pages plus live SWA pages) to the host tier, coldest first. Returns
        the device->host copies; run them before the next call that may evict the source pages."""
        if not self.cfg.num_host_full_pages or max_pages <= 0:
            return []
        cands = sorted((n for n in self._nodes.values() if n.full is not None and n.host_full is None),
                       key=lambda n: (n.access, n.start))
        copies: list[PageCopy] = []
        fresh: set[int] = set()
        for n in cands:
            if n.npages + n.n_swa > max_pages - len(copies) or not n.alive or n.full is None:
                continue
            if not self._ensure_host(n.npages, n.n_swa, fresh):
                break
            n.host_full = ids(self.host_full_pool.alloc(n.npages))
            n.host_swa = no_pages(n.npages)
            copies += [PageCopy(Group.FULL, d, h, "d2h") for d, h in zip(n.full, n.host_full, strict=True)]
            for i, s in enumerate(n.swa):  # type: ignore[arg-type]
                if s >= 0:
                    n.host_swa[i] = self.host_swa_pool.alloc_one()
                    copies.append(PageCopy(Group.SWA, s, n.host_swa[i], "d2h"))
            fresh.add(n.nid)
            self._emit(EventKind.STORED, Tier.HOST, n)
        return copies

    def _ensure_host(self, nf: int, ns: int, keep: set[int]) -> bool:
        while self.host_full_pool.num_free < nf or self.host_swa_pool.num_free < ns:
            victims = [n for n in self._nodes.values() if n.host_full is not None and n.nid not in keep and (
                (n.full is not None and n.lock == 0) or (n.full is None and not n.children))]
            if not victims:
                return False
            v = min(victims, key=lambda n: (n.access, -n.start))
            if v.full is not None:
                self._emit(EventKind.REMOVED, Tier.HOST, v)
                self._free_host_pages(v)
            else:
                parent = v.parent
                self._remove_subtree(v)
                self._prune_tombstones(parent)  # type: ignore[arg-type]
        return True

    def _free_host_pages(self, node: Node) -> None:
        self.host_full_pool.free(node.host_full)  # type: ignore[arg-type]
        self.host_swa_pool.free(s for s in node.host_swa if s >= 0)  # type: ignore[union-attr]
        node.host_full = node.host_swa = None

    # ------------------------------------------------------------------ events

    def drain_events(self) -> list[KVEvent]:
        """The pending events, oldest first (ids consecutive unless the bounded queue dropped some)."""
        out = [KVEvent(eid, kind, tier, hashes, ph, _materialise(flags, len(hashes)), _materialise(held, len(hashes)))
               for eid, kind, tier, hashes, ph, flags, held in self._events]
        self._events.clear()
        return out

    def _emit(self, kind: EventKind, tier: Tier, node: Node) -> None:
        """Queue an event as a plain tuple; `drain_events` builds the KVEvent. The flags are fixed now (they say
        what was valid when the event was made) but kept compact: the index of the first valid page, or the
        tuple itself in the rare case the valid pages are not a suffix of the node."""
        parent = node.parent
        ph = parent.hashes[-1] if parent is not None and parent.hashes else None
        if kind is EventKind.STORED:
            flags, held = self._flags_spec(node), _held_spec(node.host_swa if tier is Tier.HOST else node.swa)
        else:
            flags = held = len(node.hashes)
        self._events.append((self._next_event, kind, tier, node.hashes, ph, flags, held))
        self._next_event += 1

    def _checkpoint_flags(self, node: Node) -> tuple[bool, ...]:
        """Per block of `node`: would a hit ending after it be valid (SWA held for the window before it)?"""
        return _materialise(self._flags_spec(node), node.npages)

    def _flags_spec(self, node: Node) -> int | tuple[bool, ...]:
        """`_checkpoint_flags` compactly: an int k means pages k.. are valid and the ones before are not.
        Only pages holding SWA can end a checkpoint, so the scan visits those (few, under retention)."""
        swa = node.swa if node.full is not None else node.host_swa
        n = node.npages
        if swa is None:
            return n
        c = node.n_swa if node.full is not None else node.host_swa_count()
        if c == 0:
            return n
        wp = self.wp
        # Retention leaves SWA mostly at a node's end (nodes are cut at checkpoint ends): check that in C. Along
        # a contiguous SWA run the run length grows by one per page and the bar min(page + 1, wp) by at most
        # one, so the valid pages of the tail are a suffix: the first one is the answer. The run before the node
        # matters only when the node's SWA pages start at its first page.
        if swa[n - c:].count(-1) == 0:
            run = self._run_before(node) if c == n else 0
            for i in range(n - c, n):
                run += 1
                if run >= min(node.start + i + 1, wp):
                    return i
            return n
        out = [False] * n
        run, prev = self._run_before(node), -1
        for i in (i for i, s in enumerate(swa) if s >= 0):
            run = run + 1 if i == prev + 1 else 1
            prev = i
            out[i] = run >= min(node.start + i + 1, wp)
        return tuple(out)

    def _run_before(self, node: Node) -> int:
        """Consecutive pages holding SWA KV just before `node`, counted up to the window's pages."""
        wp = self.wp
        run = 0
        anc = node.parent
        while anc is not None and anc.parent is not None and run < wp:
            k = 0
            while k < anc.npages and k < wp and anc.swa_at(anc.npages - 1 - k):
                k += 1
            run += k
            if k < anc.npages:
                break
            anc = anc.parent
        return run

    # ------------------------------------------------------------------ usage and invariants

    def usage(self) -> PoolUsage:
        def host(pool: PagePool) -> PoolStats:
            return PoolStats(pool.capacity, pool.num_free, pool.capacity - pool.num_free, 0)

        return PoolUsage(
            full=PoolStats(self.full_pool.capacity, self.full_pool.num_free, self._tree_full - self._locked_full,
                           self._locked_full + self._private_full, self._reserved_full),
            swa=PoolStats(self.swa_pool.capacity, self.swa_pool.num_free,
                          self._tree_swa - self._locked_swa + self._lazy_swa,
                          self._locked_swa + self._private_swa, self._reserved_swa),
            host_full=host(self.host_full_pool), host_swa=host(self.host_swa_pool))

    def check_invariants(self) -> None:
        from libs.kvcache.invariants import check_cache

        check_cache(self)


def _full_evictable(n: Node) -> bool:
    return n.alive and n.full is not None and n.lock == 0 and not n.has_device_child()


def _swa_evictable(n: Node) -> bool:
    return n.alive and n.n_swa > 0 and n.swa_lock == 0



def _from(plan: RetentionPlan, x0: int) -> RetentionPlan:
    """The plan's checkpoints at or past token `x0` (with their kinds)."""
    keep = [i for i, x in enumerate(plan.checkpoints) if x >= x0]
    return RetentionPlan(plan.keep_all, tuple(plan.checkpoints[i] for i in keep),
                         tuple(plan.kind_of(i) for i in keep))


def _held_spec(swa: array | None) -> int | tuple[bool, ...]:
    """`KVEvent.swa_held` compactly (as `_flags_spec`): an int k = pages k.. hold SWA KV, else the tuple."""
    if swa is None:
        return 0
    c = len(swa) - swa.count(-1)
    n = len(swa)
    return n - c if swa[n - c:].count(-1) == 0 else tuple(s >= 0 for s in swa)


def _materialise(flags: int | tuple[bool, ...], n: int) -> tuple[bool, ...]:
    """Event flags from their compact form (see `_flags_spec`)."""
    if type(flags) is int:
        return (False,) * flags + (True,) * (n - flags)  # type: ignore[operator]
    return flags  # type: ignore[return-value]
