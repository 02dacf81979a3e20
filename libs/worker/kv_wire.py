"""KV events, snapshots and hit reports: cache / index types <-> wire messages (pure; no torch, no IO).

Both sides import this: the engine workers when they publish (libs/worker/kv_events.py) and the router when
it feeds `libs.routing.ClusterPrefixIndex` (`kv_event`, `routing_snapshot`). It pulls in only
`libs.kvcache.types`, `libs.routing.index` and `protos`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from libs.kvcache.config import KVCacheConfig
from libs.kvcache.types import CacheSnapshot, EventKind, KVEvent, Tier
from libs.routing.index import KVSnapshot
from protos.messages import (
    KV_LAYOUT_LABELS,
    KVEventBatch,
    KVEventKind,
    KVHitReport,
    KVSnapshotReply,
    KVTier,
    WireKVEvent,
)

MAX_BATCH_BLOCKS = 1024  # default bound on the block hashes of one KVEventBatch

_KIND_TO_WIRE = {EventKind.STORED: KVEventKind.STORED, EventKind.REMOVED: KVEventKind.REMOVED,
                 EventKind.SWA_REMOVED: KVEventKind.SWA_REMOVED}
_KIND_FROM_WIRE = {v: k for k, v in _KIND_TO_WIRE.items()}
_TIER_TO_WIRE = {Tier.DEVICE: KVTier.DEVICE, Tier.HOST: KVTier.HOST}
_TIER_FROM_WIRE = {v: k for k, v in _TIER_TO_WIRE.items()}


def wire_event(ev: KVEvent) -> WireKVEvent:
    """One cache event on the wire (same fields; the flag tuples as lists)."""
    return WireKVEvent(event_id=ev.event_id, kind=_KIND_TO_WIRE[ev.kind], tier=_TIER_TO_WIRE[ev.tier],
                       block_hashes=list(ev.block_hashes), parent_hash=ev.parent_hash,
                       swa_checkpoint=list(ev.swa_checkpoint), swa_held=list(ev.swa_held))


def kv_event(w: WireKVEvent) -> KVEvent:
    """A wire event back as the cache's `KVEvent` (what `ClusterPrefixIndex.apply` takes)."""
    return KVEvent(w.event_id, _KIND_FROM_WIRE[w.kind], _TIER_FROM_WIRE[w.tier], tuple(w.block_hashes),
                   w.parent_hash, tuple(w.swa_checkpoint), tuple(w.swa_held))


def kv_events(batch: KVEventBatch) -> list[KVEvent]:
    return [kv_event(w) for w in batch.events]


def runs(events: Sequence[KVEvent], max_blocks: int = MAX_BATCH_BLOCKS) -> list[list[KVEvent]]:
    """`events` (oldest first) cut into runs of consecutive ids holding at most `max_blocks` block hashes
    each (an event larger than that alone). A cut at an id gap keeps the gap visible: the next batch starts
    past it, and the router asks a snapshot."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    out: list[list[KVEvent]] = []
    cur: list[KVEvent] = []
    size = 0
    for ev in events:
        n = len(ev.block_hashes)
        if cur and (ev.event_id != cur[-1].event_id + 1 or size + n > max_blocks):
            out.append(cur)
            cur, size = [], 0
        cur.append(ev)
        size += n
    if cur:
        out.append(cur)
    return out


def event_batches(instance_id: str, epoch: str, events: Sequence[KVEvent],
                  max_blocks: int = MAX_BATCH_BLOCKS) -> list[KVEventBatch]:
    """The KVEventBatch messages carrying `events` (see `runs`)."""
    return [KVEventBatch(instance_id=instance_id, epoch=epoch, events=[wire_event(e) for e in run])
            for run in runs(events, max_blocks)]


def snapshot_reply(instance_id: str, epoch: str, snap: CacheSnapshot) -> KVSnapshotReply:
    return KVSnapshotReply(instance_id=instance_id, epoch=epoch, last_event_id=snap.last_event_id,
                           block_hashes=list(snap.block_hashes), states=list(snap.states))


def routing_snapshot(reply: KVSnapshotReply) -> KVSnapshot:
    """A snapshot reply as the index loads it (`ClusterPrefixIndex.load_snapshot`)."""
    return KVSnapshot(reply.last_event_id, tuple(reply.block_hashes), bytes(reply.states))


def hit_reports(instance_id: str, admissions: Iterable[tuple[str, int, int]]) -> list[KVHitReport]:
    """One KVHitReport per (request id, prompt tokens, cached tokens) admission."""
    return [KVHitReport(request_id=rid, instance_id=instance_id, prompt_tokens=n, cached_tokens=hit)
            for rid, n, hit in admissions]


def layout_labels(cfg: KVCacheConfig) -> dict[str, str]:
    """The registry labels `KV_LAYOUT_LABELS` (decimal strings) of a worker whose cache has `cfg`: what
    `ClusterPrefixIndex(page_size, window, rebuild_tokens)` and `block_hashes(tokens, page_size, seed)` need."""
    values = (cfg.page_size, cfg.window, cfg.rebuild_tokens, cfg.hash_seed)
    return {k: str(v) for k, v in zip(KV_LAYOUT_LABELS, values, strict=True)}
