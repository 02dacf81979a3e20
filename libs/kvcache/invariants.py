"""`check_invariants` for KVCache: recomputes every counter and ownership from scratch and compares.

Kept apart from the hot path; it reads the cache's private state on purpose (it is the cache's own audit).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from libs.kvcache.hashing import chain_hashes
from libs.kvcache.tree import Node, path_to_root

if TYPE_CHECKING:
    from libs.kvcache.cache import KVCache
    from libs.kvcache.sequence import Seq


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def check_cache(c: KVCache) -> None:
    nodes = _check_tree(c)
    _check_checkpoint_flags(c, nodes)
    _check_locks(c, nodes)
    owners = _check_counters(c, nodes)
    _check_sequences(c)
    _check_pools(c, owners)


def _check_tree(c: KVCache) -> list[Node]:
    out: list[Node] = []
    stack = [c.root]
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
            if n.host_full is not None and (len(n.host_full) != n.npages or len(n.host_swa) != n.npages):  # type: ignore[arg-type]
                _fail(f"{where}: host page list lengths differ from npages")
            if not n.children and n.is_tombstone() and n.lock == 0:
                _fail(f"{where}: unlocked tombstone leaf (no SWA KV anywhere, nothing below)")
            _check_chain(c, parent, n, where)
            if c._nodes.get(n.nid) is not n:
                _fail(f"{where}: missing from the node index")
            out.append(n)
            stack.append(n)
    if len(out) != len(c._nodes):
        _fail(f"node index holds {len(c._nodes)} nodes, the tree {len(out)}")
    return out


def _check_checkpoint_flags(c: KVCache, nodes: list[Node]) -> None:
    """The event flags (`swa_checkpoint`) equal a brute-force scan: a hit ending after page g is valid when every
    page of the window before it holds SWA KV (device or host)."""
    for n in nodes:
        chain = list(reversed(path_to_root(n)))
        present = [a.swa_at(i) for a in chain for i in range(a.npages)]
        want = tuple(all(present[max(0, g + 1 - c.wp):g + 1]) for g in range(n.start, n.end))
        if c._checkpoint_flags(n) != want:
            _fail(f"node {n.nid}: checkpoint flags {c._checkpoint_flags(n)} != brute force {want}")


def _check_chain(c: KVCache, parent: Node, n: Node, where: str) -> None:
    """Block hashes chain from the parent. The tree keeps only hashes; with `audit_tokens` the cache remembers
    each page's tokens, so the whole chain is recomputed from tokens (tests construct the cache that way)."""
    if c._audit is None:
        return
    h = parent.hashes[-1] if parent.hashes else c.cfg.hash_seed
    for i, want in enumerate(n.hashes):
        toks = c._audit.get(want)
        if toks is None or chain_hashes(toks, c.P, h, 0, 1) != [want]:
            _fail(f"{where}: block hash {i} does not chain from the parent (tokens "
                  f"{'unknown' if toks is None else toks})")
        h = want


def _check_locks(c: KVCache, nodes: list[Node]) -> None:
    want_lock: Counter[int] = Counter()
    want_swa: Counter[int] = Counter()
    holders = list(c._hits.values())
    holders += [(s.lock_node, s.hit_tokens, s.swa_locked) for s in c._seqs.values() if s.lock_node is not None]
    for deepest, hit_len, swa in holders:
        if not deepest.alive or deepest.end * c.P != hit_len:
            _fail(f"lock holder of {hit_len} tokens points at node {deepest.nid} ending at page {deepest.end}")
        ws = max(0, hit_len // c.P - c.wp)
        for n in path_to_root(deepest):
            want_lock[n.nid] += 1
            if swa and n.start >= ws:
                want_swa[n.nid] += 1
                if n.full is None:
                    _fail(f"node {n.nid}: SWA-locked but not on device")
            if n.full is None:
                _fail(f"node {n.nid}: locked but not on device")
    for n in nodes:
        if n.lock < 0 or n.swa_lock < 0:
            _fail(f"node {n.nid}: negative lock count ({n.lock}, {n.swa_lock})")
        if n.lock != want_lock[n.nid] or n.swa_lock != want_swa[n.nid]:
            _fail(f"node {n.nid}: lock={n.lock} swa_lock={n.swa_lock}, holders say "
                  f"{want_lock[n.nid]} / {want_swa[n.nid]}")


def _check_counters(c: KVCache, nodes: list[Node]) -> dict[str, list[int]]:
    owners: dict[str, list[int]] = {"full": [], "swa": [], "host_full": [], "host_swa": []}
    locked_f = locked_s = 0
    for n in nodes:
        if n.full is not None:
            owners["full"] += n.full
            owners["swa"] += [s for s in n.swa if s >= 0]  # type: ignore[union-attr]
            locked_f += n.npages if n.lock else 0
            locked_s += n.n_swa if n.swa_lock else 0
        if n.host_full is not None:
            owners["host_full"] += n.host_full
            owners["host_swa"] += [s for s in n.host_swa if s >= 0]  # type: ignore[union-attr]
    tree_f, tree_s = len(owners["full"]), len(owners["swa"])
    priv_f = priv_s = lazy_s = 0
    for s in c._seqs.values():
        pf = [p for p in s.full[s.hit_pages:] if p >= 0]
        ps = [p for j, p in enumerate(s.swa) if p >= 0 and j >= s.swa_from and j not in s.lazy]
        owners["full"] += pf
        owners["swa"] += ps + [s.swa[j] for j in s.lazy]
        priv_f += len(pf)
        priv_s += len(ps)
        lazy_s += len(s.lazy)
    got = (c._tree_full, c._tree_swa, c._locked_full, c._locked_swa, c._private_full, c._private_swa, c._lazy_swa)
    want = (tree_f, tree_s, locked_f, locked_s, priv_f, priv_s, lazy_s)
    if got != want:
        _fail(f"counters (tree full/swa, locked full/swa, private full/swa, lazy swa) are {got}, recomputed {want}")
    res_f = sum(s.full_outstanding() for s in c._seqs.values())
    res_s = sum(s.swa_outstanding() for s in c._seqs.values())
    if (c._reserved_full, c._reserved_swa) != (res_f, res_s):
        _fail(f"reserved counters {(c._reserved_full, c._reserved_swa)} != recomputed {(res_f, res_s)}")
    u = c.usage()
    for name, st in (("full", u.full), ("swa", u.swa), ("host_full", u.host_full), ("host_swa", u.host_swa)):
        if st.free + st.cached + st.in_use != st.capacity:
            _fail(f"{name} pool: free {st.free} + cached {st.cached} + in_use {st.in_use} != capacity {st.capacity}")
        if st.free + st.cached < st.reserved:
            _fail(f"{name} pool: promised {st.reserved} pages but only {st.free + st.cached} free or evictable")
    return owners


def _check_sequences(c: KVCache) -> None:
    P, wp = c.P, c.wp
    for s in c._seqs.values():
        where = f"sequence {s.seq_id!r}"
        if len(s.full) != len(s.swa) or len(s.full) * P < s.reserved_upto:
            _fail(f"{where}: page tables cover {len(s.full)} pages for {s.reserved_upto} reserved tokens")
        if not s.swa_from * P <= s.num_computed <= min(s.reserved_upto, len(s.tokens)):
            _fail(f"{where}: num_computed {s.num_computed} outside [hit, reserved/tokens]")
        if any(p < 0 for p in s.full):
            _fail(f"{where}: a page without a full page")
        _check_rebuild(c, s, where)
        _check_lazy(c, s, where)
        if s.keep_all:
            continue
        window = [j for j in range(s.swa_from, len(s.swa)) if s.swa[j] >= 0 and j not in s.keep]
        first = max(s.swa_from, s.num_computed // P - wp)
        if any(j < first for j in window):
            _fail(f"{where}: SWA page(s) {[j for j in window if j < first]} left the window but were not freed")
        resting = -(-s.num_computed // P) - first
        bound = -(-s.reserved_upto // P) - first if s.reserved_upto > s.num_computed else resting
        if len(window) > max(bound, 0) or (s.reserved_upto == s.num_computed and len(window) > c.cfg.seq_swa_pages):
            _fail(f"{where}: holds {len(window)} window SWA pages, bound is {min(bound, c.cfg.seq_swa_pages)} "
                  f"(window + page = {c.cfg.seq_swa_pages})")
        if s.lock_node is not None:
            chain = [p for n in reversed(path_to_root(s.lock_node)) for p in n.full]  # type: ignore[union-attr]
            if chain != s.full[:s.hit_pages].tolist():
                _fail(f"{where}: hit pages differ from the locked tree path")
        if s.lock_node is not None:
            path = [h for n in reversed(path_to_root(s.lock_node)) for h in n.hashes]
            if path != chain_hashes(s.tokens, P, c.cfg.hash_seed, 0, s.hit_pages):
                _fail(f"{where}: the locked tree path's block hashes are not the hashes of its prompt")


def _check_rebuild(c: KVCache, s: Seq, where: str) -> None:
    """A rebuild sequence (SWA from R below its tree pages [0, E)) reads no tree SWA (no SWA lock), holds no SWA
    page below R, and keeps none of its scratch pages (below one window before E) past the window."""
    sf, hp, scratch = s.swa_from, s.hit_pages, s.scratch_end
    if sf == hp:
        if scratch != sf:
            _fail(f"{where}: scratch end {scratch} on a sequence without a rebuild span")
        return
    if not sf < scratch <= hp or scratch != max(sf, hp - c.wp) or s.swa_locked:
        _fail(f"{where}: rebuild span pages {sf}..{hp} with scratch end {scratch}, swa_locked {s.swa_locked}")
    if any(p >= 0 for p in s.swa[:sf]):
        _fail(f"{where}: holds SWA pages below its rebuild start page {sf}")
    kept = [j for j in s.keep | s.lazy if j < scratch]
    if kept:
        _fail(f"{where}: retains scratch SWA pages {sorted(kept)} of its rebuild span (below page {scratch})")
    want = max(hp, -(-s.reserved_upto // c.P))
    if len(s.full) != want:
        _fail(f"{where}: {len(s.full)} full pages, want the tree's {hp} then up to the reserved end: {want}")


def _check_lazy(c: KVCache, s: object, where: str) -> None:
    """Lazy pages are cold checkpoint pages that left the window, each reclaimable through the lazy queue."""
    lazy: set[int] = s.lazy  # type: ignore[attr-defined]
    first = s.num_computed // c.P - c.wp  # type: ignore[attr-defined]
    for j in lazy:
        if j not in s.keep or j >= first or j < s.swa_from or s.swa[j] < 0:  # type: ignore[attr-defined]
            _fail(f"{where}: lazy SWA page index {j} is not a kept checkpoint page below the window {first}")
    queued = {j for _, j, sid in c._lazy_q if sid == s.seq_id}  # type: ignore[attr-defined]
    if not lazy <= queued:
        _fail(f"{where}: lazy pages {sorted(lazy - queued)} cannot be reclaimed (not in the lazy queue)")
    stamps = [t for t, _, _ in c._lazy_q]
    if stamps != sorted(stamps):
        _fail("lazy queue is not oldest first (reclaim order would not be LRU)")


def _check_pools(c: KVCache, owners: dict[str, list[int]]) -> None:
    for name, pool in (("full", c.full_pool), ("swa", c.swa_pool), ("host_full", c.host_full_pool),
                       ("host_swa", c.host_swa_pool)):
        ids = owners[name] + pool.free_ids()
        if sorted(ids) != list(range(pool.capacity)):
            dup = [p for p, k in Counter(ids).items() if k > 1]
            _fail(f"{name} pool: pages owned + free are not exactly 0..{pool.capacity - 1} "
                  f"(duplicates {dup[:5]}, count {len(ids)})")
