"""The event log: numbered KVEvents (blocks entering / leaving a tier) for the router and GCache.

Events are queued as plain tuples with their checkpoint flags fixed when the event is made (kept compact: the
index of the first valid block) and built into `KVEvent` objects only when drained, so the bookkeeping of a
request nothing reuses stays cheap. The queue is bounded; dropped events leave a gap in the ids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from libs.kvcache.tree import Node, path_to_root
from libs.kvcache.types import EventKind, KVEvent, Tier

_Spec = int | tuple[bool, ...]  # a flags or held spec: see `flags_spec`
_PendingEvent = tuple[int, EventKind, Tier, tuple[int, ...], int | None, _Spec, _Spec]


class EventLog:
    """Owns the pending events and the next event id; `emit` is the only writer."""

    __slots__ = ("_pending", "_next", "_wp")

    def __init__(self, max_pending: int, window_pages: int) -> None:
        # (id, kind, tier, hashes, parent hash, flags as `flags_spec`, SWA held as `held_spec`): built into
        # KVEvents when drained
        self._pending: deque[_PendingEvent] = deque(maxlen=max_pending)
        self._next = 0
        self._wp = window_pages

    def emit(self, kind: EventKind, tier: Tier, node: Node) -> None:
        """Queue an event for `node` as it is now (the flags say what is valid at this moment)."""
        parent = node.parent
        ph = parent.hashes[-1] if parent is not None and parent.hashes else None
        if kind is EventKind.STORED:
            flags, held = flags_spec(node, self._wp), held_spec(node.host_swa if tier is Tier.HOST else node.swa,
                                                                node.npages)
        else:
            flags = held = len(node.hashes)
        self._pending.append((self._next, kind, tier, node.hashes, ph, flags, held))
        self._next += 1

    @property
    def last_id(self) -> int:
        """The id of the last event issued (-1: none yet), drained, pending or dropped."""
        return self._next - 1

    def pending(self) -> int:
        return len(self._pending)

    def drain(self) -> list[KVEvent]:
        """The pending events, oldest first (ids consecutive unless the bounded queue dropped some)."""
        out = [KVEvent(eid, kind, tier, hashes, ph, _materialise(flags, len(hashes)), _materialise(held, len(hashes)))
               for eid, kind, tier, hashes, ph, flags, held in self._pending]
        self._pending.clear()
        return out

    def check_invariants(self, nodes: Iterable[Node]) -> None:
        """Pending ids are the last ones issued, consecutive; every node's checkpoint flags (what its next
        event would say) equal a brute-force scan: a hit ending after page g is valid when every page of the
        window before it holds SWA KV (device or host)."""
        got = [e[0] for e in self._pending]
        if got != list(range(self._next - len(got), self._next)):
            raise AssertionError(f"pending event ids {got[:5]}... are not the last {len(got)} issued "
                                 f"(next id {self._next})")
        wp = self._wp
        for n in nodes:
            chain = list(reversed(path_to_root(n)))
            present = [a.swa_at(i) for a in chain for i in range(a.npages)]
            want = tuple(all(present[max(0, g + 1 - wp):g + 1]) for g in range(n.start, n.end))
            if checkpoint_flags(n, wp) != want:
                raise AssertionError(f"node {n.nid}: checkpoint flags {checkpoint_flags(n, wp)} != brute force "
                                     f"{want}")


def checkpoint_flags(node: Node, wp: int) -> tuple[bool, ...]:
    """Per block of `node`: would a hit ending after it be valid (SWA held for the window before it)?"""
    return _materialise(flags_spec(node, wp), node.npages)


def flags_spec(node: Node, wp: int) -> int | tuple[bool, ...]:
    """`checkpoint_flags` compactly: an int k means pages k.. are valid and the ones before are not.
    Only pages holding SWA can end a checkpoint, so the scan visits those (few, under retention)."""
    swa = node.swa if node.full is not None else node.host_swa
    n = node.npages
    if swa is None:
        return n
    c = node.n_swa if node.full is not None else node.host_swa_count()
    if c == 0:
        return n
    # Retention leaves SWA mostly at a node's end (nodes are cut at checkpoint ends): check that in C. Along
    # a contiguous SWA run the run length grows by one per page and the bar min(page + 1, wp) by at most
    # one, so the valid pages of the tail are a suffix: the first one is the answer. The run before the node
    # matters only when the node's SWA pages start at its first page.
    if swa[n - c:].count(-1) == 0:
        run = _run_before(node, wp) if c == n else 0
        for i in range(n - c, n):
            run += 1
            if run >= min(node.start + i + 1, wp):
                return i
        return n
    out = [False] * n
    run, prev = _run_before(node, wp), -1
    for i in (i for i, s in enumerate(swa) if s >= 0):
        run = run + 1 if i == prev + 1 else 1
        prev = i
        out[i] = run >= min(node.start + i + 1, wp)
    return tuple(out)


def held_spec(swa, n: int) -> int | tuple[bool, ...]:
    """`KVEvent.swa_held` compactly (as `flags_spec`): an int k = pages k.. of the node hold SWA KV in the
    event's tier and the ones before do not, else the tuple. `swa` is the node's SWA page array in that tier
    (None: the tier holds none of it)."""
    if swa is None:
        return n
    c = n - swa.count(-1)
    return n - c if swa[n - c:].count(-1) == 0 else tuple(s >= 0 for s in swa)


def _run_before(node: Node, wp: int) -> int:
    """Consecutive pages holding SWA KV just before `node`, counted up to the window's pages."""
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


def _materialise(flags: int | tuple[bool, ...], n: int) -> tuple[bool, ...]:
    """Event flags from their compact form (see `flags_spec`)."""
    if type(flags) is int:
        return (False,) * flags + (True,) * (n - flags)  # type: ignore[operator]
    return flags  # type: ignore[return-value]
