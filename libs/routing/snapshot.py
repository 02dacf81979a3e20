"""A worker's `KVSnapshot` from its `KVCache` (pure): what a router that started late or saw an event gap
loads (`ClusterPrefixIndex.load_snapshot`).

The cache has no snapshot method of its own yet, so this walks its prefix tree through the node attributes
(`KVCache.root`, `Node.children / hashes / full / swa / host_full / host_swa`); it belongs in `libs/kvcache`
as `KVCache.snapshot()` once the cache's split settles (docs/routing.md).
"""

from __future__ import annotations

from libs.kvcache import KVCache, KVEvent
from libs.routing.index import BlockState, KVSnapshot

_DEV, _DEV_SWA, _HOST, _HOST_SWA = (int(b) for b in BlockState)


def take_snapshot(cache: KVCache, last_event_id: int) -> tuple[list[KVEvent], KVSnapshot]:
    """(events still pending in the cache, the snapshot after them). The pending events are drained first so
    the snapshot is consistent with the last of them (or with `last_event_id`, the last event the caller
    already published, when none is pending); publish them before the snapshot, as usual."""
    pending = cache.drain_events()
    last = pending[-1].event_id if pending else last_event_id
    hashes: list[int] = []
    states = bytearray()
    stack = [cache.root]
    while stack:
        for node in stack.pop().children.values():
            stack.append(node)
            hashes.extend(node.hashes)
            for i in range(node.npages):
                st = 0
                if node.full is not None:
                    st = _DEV | (_DEV_SWA if node.swa[i] >= 0 else 0)  # type: ignore[index]
                if node.host_full is not None:
                    st |= _HOST | (_HOST_SWA if node.host_swa[i] >= 0 else 0)  # type: ignore[index]
                states.append(st)
    return pending, KVSnapshot(last, tuple(hashes), bytes(states))
