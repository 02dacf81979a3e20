"""A worker's `KVSnapshot` from its `KVCache`: what a router that started late or saw an event gap loads
(`ClusterPrefixIndex.load_snapshot`). A thin wrapper: the cache walks its own tree (`KVCache.snapshot`,
states as `libs.kvcache.BlockHeld`, the same bits as `BlockState`)."""

from __future__ import annotations

from libs.kvcache import KVCache, KVEvent
from libs.routing.index import KVSnapshot


def take_snapshot(cache: KVCache, last_event_id: int | None = None) -> tuple[list[KVEvent], KVSnapshot]:
    """(events still pending in the cache, the snapshot after them): publish the events first. The snapshot
    is consistent with the last event id the cache issued; `last_event_id` (the last one the caller
    published) is no longer needed and kept only for older callers."""
    pending, snap = cache.snapshot()
    return pending, KVSnapshot(snap.last_event_id, snap.block_hashes, snap.states)
