"""The prefix index: the radix tree of cached pages, matching (valid and rebuild hits), hit locks, insertion of
finished sequences (healing tombstones) and the execution of evictions chosen by the evictor.

It owns the tree (structure, device page ids, locks, LRU stamps of every node), the node map and the live
hits. Pages change state only through the ledger; new SWA checkpoints are counted by the reuse statistics;
copies in lower tiers are kept aligned through the tier seam.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import count

from libs.kvcache.config import KVCacheConfig
from libs.kvcache.events import EventLog
from libs.kvcache.evictor import Evictor
from libs.kvcache.hashing import chain_hashes
from libs.kvcache.ledger import Held, PageLedger
from libs.kvcache.retention import END, ReuseStats
from libs.kvcache.sequence import SeqAllocation
from libs.kvcache.tiers import HostTier, LowerTier
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
from libs.kvcache.types import EventKind, HostImport, PageCopy, PrefixHit, Tier

HitLock = tuple[Node, int, bool]  # (deepest node, hit tokens L or E, holds SWA locks)
_NO_HIT = PrefixHit(0, 0, 0)


class PrefixIndex:
    def __init__(self, cfg: KVCacheConfig, nodes: dict[int, Node], ledger: PageLedger, evictor: Evictor,
                 events: EventLog, stats: ReuseStats, tiers: Sequence[LowerTier],
                 make_room: Callable[[int, int], None], audit_tokens: bool = False) -> None:
        """`nodes`: the node map this index fills (the evictor reads it); `make_room(nf, ns)`: evict until both
        free lists hold that many pages (the front's loop over tree victims and lazy pages)."""
        self.cfg = cfg
        self.P = cfg.page_size
        self.wp = cfg.window_pages
        self.root = make_root()
        self.nodes = nodes
        self._ledger = ledger
        self._evictor = evictor
        self._events = events
        self._stats = stats
        self._tiers = tuple(tiers)
        self._make_room = make_room
        # remember each cached page's tokens so `check_invariants` can recompute every node's hash chain (tests)
        self._audit: dict[int, tuple[int, ...]] | None = {} if audit_tokens else None
        self._hits: dict[int, HitLock] = {}  # hit id -> its locks, while the hit holds them
        # With an arena and rebuilds, a tombstone leaf's full KV still serves a rebuild hit at its end (and heals
        # a later insert): it stays until the arena's value order evicts it, instead of leaving with its SWA.
        self._rebuild_end = cfg.rebuild_tokens // self.P if cfg.arena and cfg.rebuild_tokens else -1
        self.pruned_full_pages = 0  # device full pages that left with a tombstone (their SWA KV had gone)
        self._hit_ids = count(1)
        self._clock = 0

    @property
    def clock(self) -> int:
        """The LRU clock: advanced by every match that walks the tree and every insert."""
        return self._clock

    # ------------------------------------------------------------------ match / hits

    def match(self, tokens: Sequence[int], block_hashes: Sequence[int] | None, rebuild: bool) -> PrefixHit:
        """See `KVCache.match`."""
        if not self.cfg.enable_prefix_cache or len(tokens) <= self.P or not self.root.children or (
                block_hashes and block_hashes[0] not in self.root.children):  # no-reuse fast path
            return _NO_HIT
        path = walk(self.root, PromptHashes(tokens, self.P, self.cfg.hash_seed, block_hashes), len(tokens) // self.P)
        # (GCache / L3 does not extend the path here: a network lookup cannot run inside match on the engine
        # thread. Its blocks are imported into the host tier before the request arrives, `import_blocks`, and
        # the walk finds them like any host copy.)
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

    def cached_pages(self, tokens: Sequence[int], block_hashes: Sequence[int] | None) -> int:
        """Leading pages of `tokens` whose full KV the tree holds (device or host). No side effect: no LRU
        stamp, no lock, no split (the GCache lookup asks it before fetching what lies beyond)."""
        if not self.root.children:
            return 0
        path = walk(self.root, PromptHashes(tokens, self.P, self.cfg.hash_seed, block_hashes), len(tokens) // self.P)
        return sum(m for _, m in path)

    def import_blocks(self, tokens: Sequence[int], block_hashes: Sequence[int] | None, first: int, end: int,
                      host: HostTier) -> HostImport | None:
        """Hang the blocks [e, end) of `tokens` under the tree as one host-only node, e = the pages the tree holds
        now (>= `first`, what the caller fetched from): full pages for every block, SWA pages for the checkpoint
        window ending at `end`. None (nothing changed but freed host copies) when e < first (the blocks before
        the import are gone), when the window reaches below e (the local pages there may lack SWA KV: the
        simplest correct rule is to import only hits whose window lies wholly in the import) or when the host
        tier cannot make room."""
        hashes = PromptHashes(tokens, self.P, self.cfg.hash_seed, block_hashes)
        swa_from = max(0, end - self.wp)
        path = walk(self.root, hashes, end)
        e = sum(m for _, m in path)
        if not first <= e <= swa_from or end * self.P > len(tokens):
            return None
        keep = {n.nid for n, _ in path}
        if not host.make_room(end - e, end - swa_from, self.nodes.values(), keep, self.lower_copy_dropped):
            return None
        path = walk(self.root, hashes, end)  # making room may have pruned a tombstone leaf the path ended in
        if sum(m for _, m in path) != e:
            return None
        parent = self.root
        if path:
            last, m = path[-1]
            parent = last if m == last.npages else self._split(last, m)
        self._clock += 1
        h = hashes.upto(end)
        node = Node(e, parent, None, None, h[e:end], self._clock)
        parent.children[node.hashes[0]] = node
        self.nodes[node.nid] = node
        if self._audit is not None:
            P = self.P
            self._audit.update((h[j], tuple(tokens[j * P:(j + 1) * P])) for j in range(e, end))
        full, swa = host.adopt(node, swa_from)
        return HostImport(e, end, tuple(full), tuple(swa))

    def release_hit(self, hit: PrefixHit) -> None:
        entry = self._hits.pop(hit.hit_id, None)
        if entry is None:
            if hit.hit_id:
                raise KeyError(f"hit {hit.hit_id} is not live (already released or admitted)")
            return
        self.unlock(entry[0], entry[1], swa=entry[2])

    def take_over(self, hit_id: int) -> HitLock | None:
        """Hand a live hit's locks to an admission (None: no such live hit)."""
        return self._hits.pop(hit_id, None)

    @staticmethod
    def path_hashes(node: Node) -> list[int]:
        """The block hashes from the root down to `node`."""
        return [h for n in reversed(path_to_root(node)) for h in n.hashes]

    def _best_valid(self, path: list[tuple[Node, int]], max_pages: int) -> tuple[int, int]:
        """(longest valid L on device, longest valid L counting nodes in a lower tier), in tokens."""
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
        """A rebuild hit at the end E of the full-KV match (lower-tier nodes loaded; else the device part alone),
        only when it skips more than the best valid hit: R = E - rebuild_tokens > best."""
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
                    self._stats.rebuild_matched()
                    return hit
        return None

    def _take_hit(self, path: list[tuple[Node, int]], hit_len: int, raw: int, skip: int = -1) -> PrefixHit | None:
        """Split the tree so the hit and its window end at node boundaries, lock it, load lower-tier nodes.

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
        if not self._ledger.fits(lock_f + load_f, lock_s + load_s):
            return None
        self._lock(deepest, ws)
        copies, l3_pages = self._load(loads, load_f, load_s)
        age = self._clock - deepest.swa_access
        for n in chain:
            n.access = self._clock
            if n.start >= ws:
                n.swa_access = self._clock
        hid = next(self._hit_ids)
        self._hits[hid] = (deepest, hit_len, not rebuild)
        if not rebuild and self._stats.reused(deepest, age):
            self._evictor.rekey_swa()
        full_pages: list[int] = []
        swa_pages: list[int] = []
        for n in reversed(chain):
            full_pages += n.full  # type: ignore[arg-type]
            swa_pages += n.swa if n.start >= ws else no_pages(n.npages)  # type: ignore[arg-type]
        return PrefixHit(skip if rebuild else hit_len, raw, load_f * self.P, tuple(full_pages),
                         tuple(swa_pages), tuple(copies), hid, hit_len, l3_pages * self.P)

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
        for tier in self._tiers:
            tier.split(head, node, k)
        self.nodes[head.nid] = head
        if head.n_swa:
            self._evictor.push_swa(head)
        return head

    def _load(self, loads: list[Node], nf: int, ns: int) -> tuple[list[PageCopy], int]:
        """Give lower-tier nodes (already locked) device pages: (the copies for the engine to run, pages of them
        imported from GCache and loaded for the first time)."""
        if not loads:
            return [], 0
        self._make_room(nf, ns)
        tier = self._tiers[0]  # nodes off the device live in L2 (GCache imports into L2 as well)
        copies: list[PageCopy] = []
        l3_pages = 0
        for n in loads:
            if tier.from_store(n):
                l3_pages += n.npages
            full, swa = self._ledger.load(n.npages, tier.swa_count(n), n.swa_lock > 0)
            dev_swa, cps = tier.restore(n, full, swa)
            n.full, n.swa, n.n_swa = full, ids(dev_swa), len(swa)
            copies += cps
            self._events.emit(EventKind.STORED, Tier.DEVICE, n)
        return copies, l3_pages

    # ------------------------------------------------------------------ locks

    def _lock(self, deepest: Node, ws: int) -> None:
        nf = ns = 0
        for n in path_to_root(deepest):
            if n.lock == 0 and n.full is not None:
                nf += len(n.full)
            n.lock += 1
            if n.start >= ws:
                if n.swa_lock == 0:
                    ns += n.n_swa
                n.swa_lock += 1
        self._ledger.lock(nf, ns)

    def unlock(self, deepest: Node, hit_len: int, swa: bool, full: bool = True) -> None:
        """Give back one holder's locks on the path to `deepest` (SWA locks of its window if `swa`; full locks
        unless `full` is False: a running sequence whose window left the hit keeps those)."""
        ws = max(0, hit_len // self.P - self.wp)
        chain = path_to_root(deepest)
        evictor = self._evictor
        nf = ns = 0
        if swa:
            for n in chain:
                if n.start < ws:
                    break
                n.swa_lock -= 1
                if n.swa_lock == 0:
                    ns += n.n_swa
                    evictor.push_swa(n)
        if full:
            for n in chain:
                n.lock -= 1
                if n.lock == 0:
                    if n.full is not None:
                        nf += len(n.full)
                    evictor.push_full(n)
        self._ledger.lock(-nf, -ns)
        if full:
            self._prune_tombstones(deepest)

    # ------------------------------------------------------------------ insert

    def insert(self, seq: SeqAllocation) -> int:
        """Hand a finishing sequence's pages [hit_pages, computed pages) to the tree, or free them as duplicates
        (writing -1 into its page tables where the tree took or freed a page); returns the end page."""
        npg = seq.num_computed // self.P
        if npg <= seq.swa_from:
            return seq.hit_pages
        self._clock += 1
        hashes = PromptHashes(seq.tokens, self.P, self.cfg.hash_seed, seq.hashes)
        node, pos = self.root, 0
        tail: Node | None = None
        while pos < npg and node.children:
            child = node.children.get(hashes.upto(pos + 1)[pos])
            if child is None:
                break
            m = common_pages(child, hashes, pos, npg - pos)
            if m < child.npages:
                tail, child = child, self._split(child, m)
            self._absorb(child, seq, pos)
            child.access = self._clock
            pos, node = pos + child.npages, child
        if pos < npg:
            self._add_nodes(node, seq, pos, npg, hashes.upto(npg))
        if tail is not None and tail.alive and not tail.children and tail.lock == 0 and tail.is_tombstone():
            # A leaf split where it diverges keeps its tail: when the tail holds no SWA KV (its checkpoint window
            # was only partly kept, the rest of the leaf evicted) it is a tombstone leaf that no hit can use
            self._prune_tombstones(tail)
        return max(npg, seq.hit_pages)

    def _absorb(self, node: Node, seq: SeqAllocation, pos: int) -> None:
        """The sequence recomputed pages the tree already has: drop duplicates, heal tombstones, fill nodes off
        the device back with the sequence's pages. (A rebuild's SWA pages below its tree pages heal the
        tombstones its hit started from; its full pages there are the tree's own.)"""
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
        self._ledger.free_private(dup_full, dup_swa)
        if healed:
            node.n_swa += healed
            self._ledger.to_tree(0, healed, healed if node.swa_lock else 0)
            node.swa_access = self._clock
            self._learn(node, seq)
            self._evictor.push_swa(node)
            self._events.emit(EventKind.STORED, Tier.DEVICE, node)

    def _adopt(self, node: Node, seq: SeqAllocation, pos: int) -> None:
        n = node.npages
        node.full = ids(seq.full[pos:pos + n])
        node.swa = ids(seq.swa[pos:pos + n])
        seq.full[pos:pos + n] = no_pages(n)
        seq.swa[pos:pos + n] = no_pages(n)
        node.n_swa = len(node.swa) - node.swa.count(-1)
        self._ledger.to_tree(n, node.n_swa)
        node.swa_access = self._clock
        self._learn(node, seq)
        self._evictor.push_full(node)
        self._evictor.push_swa(node)
        self._events.emit(EventKind.STORED, Tier.DEVICE, node)

    def _add_nodes(self, parent: Node, seq: SeqAllocation, pos: int, npg: int, hashes: Sequence[int]) -> None:
        """New nodes for pages [pos, npg), cut at checkpoint ends so each checkpoint ends a node (SWA eviction
        and locking then work on whole checkpoints)."""
        cuts = sorted({e for e in seq.ckpt_ends if pos < e < npg} | {npg})
        if self._audit is not None:
            P = self.P
            self._audit.update((hashes[j], tuple(seq.tokens[j * P:(j + 1) * P])) for j in range(pos, npg))
        nodes, evictor, emit, clock = self.nodes, self._evictor, self._events.emit, self._clock
        learn, ckpt_kinds, seq_end = self._stats.learn, seq.ckpt_kinds, seq.num_computed // self.P
        first, n_swa = pos, 0
        for end in cuts:
            node = Node(pos, parent, seq.full[pos:end], seq.swa[pos:end], hashes[pos:end], clock)
            parent.children[node.hashes[0]] = node
            nodes[node.nid] = node
            if node.n_swa:
                n_swa += node.n_swa
                # `_learn` inlined (once per node of every insert)
                if learn(node, ckpt_kinds.get(end, 0) | (END if end == seq_end else 0)):
                    evictor.rekey_swa()
                evictor.push_swa(node)
            emit(EventKind.STORED, Tier.DEVICE, node)
            parent, pos = node, end
        # The tree owns the pages now (counted once per insert, not per node).
        seq.full[first:npg] = seq.swa[first:npg] = no_pages(npg - first)
        self._ledger.to_tree(npg - first, n_swa)
        evictor.push_full(parent)

    def _learn(self, node: Node, seq: SeqAllocation) -> None:
        """A node that now holds SWA pages of `seq` learns the kinds of the checkpoint ending at its end."""
        if not node.n_swa:
            return
        kinds: int = seq.ckpt_kinds.get(node.end, 0)
        if node.end == seq.num_computed // self.P:
            kinds |= END
        if self._stats.learn(node, kinds):
            self._evictor.rekey_swa()

    # ------------------------------------------------------------------ eviction (victims chosen by the evictor)

    def evict_device(self, node: Node) -> None:
        """Full-LRU victim (an unlocked device leaf): off the device if a lower tier holds it, else out of the
        tree."""
        parent = node.parent
        if node.host_full is not None and (node.children or node.host_swa_count()):
            self._free_device_pages(node)
            self._events.emit(EventKind.REMOVED, Tier.DEVICE, node)
        else:
            self._remove_subtree(node)
        self._prune_tombstones(parent)  # type: ignore[arg-type]

    def evict_swa(self, node: Node) -> bool:
        """SWA-LRU victim: drop the node's SWA pages (a tombstone); a tombstone leaf leaves the tree (unless it
        is kept for rebuild hits, `keeps_tombstone`). True if the node left the tree."""
        self._ledger.free_tree_swa(live(node.swa, node.n_swa))  # type: ignore[arg-type]
        self._stats.evicted(node, self._clock - node.swa_access)
        node.swa = no_pages(node.npages)
        node.n_swa = 0
        if node.children or node.lock or not node.is_tombstone() or self.keeps_tombstone(node):
            self._events.emit(EventKind.SWA_REMOVED, Tier.DEVICE, node)  # the blocks stay: say their SWA went
            return False
        self._prune_tombstones(node)  # the node leaves now and REMOVED says it all
        return True

    def keeps_tombstone(self, node: Node) -> bool:
        """A device tombstone leaf stays (arena with rebuilds): a rebuild hit at its end skips tokens."""
        return 0 <= self._rebuild_end < node.end and node.full is not None

    def lower_copy_dropped(self, node: Node) -> None:
        """A lower tier dropped its copy of `node`. A node that lived only there (a leaf) leaves the tree; one
        on the device whose only SWA KV was that copy is a tombstone now, and leaves it when it is an unlocked
        leaf (tombstone leaves are never kept: they can serve no hit)."""
        if node.full is None:
            parent = node.parent
            self._remove_subtree(node)
            self._prune_tombstones(parent)  # type: ignore[arg-type]
        elif not node.children and node.lock == 0 and node.is_tombstone():
            self._prune_tombstones(node)

    def _free_device_pages(self, node: Node) -> None:
        self._ledger.free_tree(node.full, live(node.swa, node.n_swa))  # type: ignore[arg-type]
        node.full = node.swa = None
        node.n_swa = 0

    def _remove_subtree(self, node: Node) -> None:
        assert node.lock == 0, "removing a locked node"
        for child in list(node.children.values()):
            self._remove_subtree(child)
        if node.full is not None:
            self._events.emit(EventKind.REMOVED, Tier.DEVICE, node)
            self._free_device_pages(node)
        for tier in self._tiers:
            tier.free(node)
        del node.parent.children[node.hashes[0]]  # type: ignore[union-attr]
        del self.nodes[node.nid]
        node.alive = False

    def _prune_tombstones(self, node: Node) -> None:
        """Remove unlocked tombstone leaves upward from `node`; note a parent that became a device leaf."""
        while node.parent is not None:
            parent = node.parent
            if not node.children and node.lock == 0 and node.is_tombstone() and not self.keeps_tombstone(node):
                if node.full is not None:
                    self.pruned_full_pages += node.npages
                self._remove_subtree(node)
            elif node.full is not None and node.lock == 0 and not node.has_device_child():
                self._evictor.push_full(node)
                return
            else:
                return
            node = parent

    # ------------------------------------------------------------------ audit

    def check_invariants(self, holders: Sequence[HitLock]) -> tuple[list[Node], Held]:
        """Tree shape, hash chains, lock counts against the live hits and `holders` (running sequences' locks);
        returns the live nodes and the device pages they hold (for the ledger's audit)."""
        nodes = self._check_tree()
        self._check_locks(nodes, [*self._hits.values(), *holders])
        held = Held()
        for n in nodes:
            if n.full is not None:
                held.full += n.full
                held.swa += [s for s in n.swa if s >= 0]  # type: ignore[union-attr]
                held.locked_full += n.npages if n.lock else 0
                held.locked_swa += n.n_swa if n.swa_lock else 0
        return nodes, held

    def _check_tree(self) -> list[Node]:
        out: list[Node] = []
        stack = [self.root]
        while stack:
            parent = stack.pop()
            for key, n in parent.children.items():
                where = f"node {n.nid} (pages {n.start}..{n.end})"
                if not n.alive or n.parent is not parent or n.npages == 0 or key != n.hashes[0]:
                    _fail(f"{where}: broken parent/child link (the child key is its first block hash)")
                if n.start != parent.end:
                    _fail(f"{where}: starts at page {n.start}, its parent ends at {parent.end}")
                if n.full is not None:
                    if len(n.full) != n.npages or len(n.swa) != n.npages:  # type: ignore[arg-type]
                        _fail(f"{where}: page list lengths differ from npages")
                    if n.n_swa != sum(1 for s in n.swa if s >= 0):  # type: ignore[union-attr,misc]
                        _fail(f"{where}: n_swa={n.n_swa} is stale")
                    if parent.parent is not None and parent.full is None:
                        _fail(f"{where}: on device under a host-only parent")
                elif n.host_full is None:
                    _fail(f"{where}: neither on device nor on host")
                elif n.n_swa:
                    _fail(f"{where}: host-only node counts device SWA pages")
                if not n.children and n.is_tombstone() and n.lock == 0 and not self.keeps_tombstone(n):
                    _fail(f"{where}: unlocked tombstone leaf (no SWA KV anywhere, nothing below)")
                self._check_chain(parent, n, where)
                if self.nodes.get(n.nid) is not n:
                    _fail(f"{where}: missing from the node index")
                out.append(n)
                stack.append(n)
        if len(out) != len(self.nodes):
            _fail(f"node index holds {len(self.nodes)} nodes, the tree {len(out)}")
        return out

    def _check_chain(self, parent: Node, n: Node, where: str) -> None:
        """Block hashes chain from the parent. The tree keeps only hashes; with `audit_tokens` the index
        remembers each page's tokens, so the whole chain is recomputed from tokens (tests build it that way)."""
        if self._audit is None:
            return
        h = parent.hashes[-1] if parent.hashes else self.cfg.hash_seed
        for i, want in enumerate(n.hashes):
            toks = self._audit.get(want)
            if toks is None or chain_hashes(toks, self.P, h, 0, 1) != [want]:
                _fail(f"{where}: block hash {i} does not chain from the parent (tokens "
                      f"{'unknown' if toks is None else toks})")
            h = want

    def _check_locks(self, nodes: list[Node], holders: list[HitLock]) -> None:
        want_lock: dict[int, int] = {}
        want_swa: dict[int, int] = {}
        for deepest, hit_len, swa in holders:
            if not deepest.alive or deepest.end * self.P != hit_len:
                _fail(f"lock holder of {hit_len} tokens points at node {deepest.nid} ending at page {deepest.end}")
            ws = max(0, hit_len // self.P - self.wp)
            for n in path_to_root(deepest):
                want_lock[n.nid] = want_lock.get(n.nid, 0) + 1
                if swa and n.start >= ws:
                    want_swa[n.nid] = want_swa.get(n.nid, 0) + 1
                    if n.full is None:
                        _fail(f"node {n.nid}: SWA-locked but not on device")
                if n.full is None:
                    _fail(f"node {n.nid}: locked but not on device")
        for n in nodes:
            if n.lock < 0 or n.swa_lock < 0:
                _fail(f"node {n.nid}: negative lock count ({n.lock}, {n.swa_lock})")
            if n.lock != want_lock.get(n.nid, 0) or n.swa_lock != want_swa.get(n.nid, 0):
                _fail(f"node {n.nid}: lock={n.lock} swa_lock={n.swa_lock}, holders say "
                      f"{want_lock.get(n.nid, 0)} / {want_swa.get(n.nid, 0)}")


def _fail(msg: str) -> None:
    raise AssertionError(msg)
