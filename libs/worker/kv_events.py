"""The KV-affinity feed of an engine worker: its cache's events on the bus, snapshots, and hit reports.

`KVFeed.on_step` (an engine step hook, on the engine thread) drains the cache's events and admissions into
an outbox every `interval_s` and whenever the engine idles; `run()` publishes them as `KVEventBatch`es
(consecutive ids, at most `max_batch_blocks` blocks each) and one `KVHitReport` per admission;
`answer_snapshot()` publishes the outbox before the snapshot reply. Ids are the cache's own event ids;
`epoch` is new per process start. Backpressure: past `max_queued` undelivered events the hook stops
draining, the cache's bounded queue drops the oldest, and the router sees the gap and asks a snapshot: no
gap is papered over. Details: docs/worker.md, "KV events".
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import BaseModel

from libs.engine.async_engine import AsyncEngine
from libs.engine.core import EngineCore
from libs.engine.request import AdmittedHit
from libs.kvcache.types import CacheSnapshot, KVEvent
from libs.worker.kv_wire import MAX_BATCH_BLOCKS, event_batches, hit_reports, snapshot_reply
from protos import subjects
from protos.messages import KVSnapshotReply, KVSnapshotRequest

log = logging.getLogger("windserve.worker.kv_events")

Publish = Callable[[str, BaseModel], Awaitable[None]]


@dataclass
class FeedStats:
    batches: int = 0
    events: int = 0
    hit_reports: int = 0
    snapshots: int = 0
    failures: int = 0  # publishes that failed (their events are gone: the router sees the gap)

    def as_details(self) -> dict[str, str]:
        return {"kv_event_batches": str(self.batches), "kv_events_published": str(self.events),
                "kv_hit_reports": str(self.hit_reports), "kv_snapshots": str(self.snapshots),
                "kv_event_failures": str(self.failures)}


class KVFeed:
    """One engine worker's feed (module docstring). `publish(subject, msg)` is the bus's publish. `events`:
    publish the cache's events (and answer snapshots); `hits`: publish hit reports."""

    def __init__(self, engine: AsyncEngine, publish: Publish, namespace: str, instance_id: str, *,
                 events: bool = True, hits: bool = True, interval_s: float = 0.005,
                 max_batch_blocks: int = MAX_BATCH_BLOCKS, max_queued: int = 1 << 16) -> None:
        self.engine = engine
        self.publish = publish
        self.instance_id = instance_id
        self.epoch = uuid.uuid4().hex
        self.events_on, self.hits_on = events, hits
        self.interval_s = interval_s
        self.max_batch_blocks = max_batch_blocks
        self.max_queued = max_queued
        self.events_subject = subjects.kv_events(namespace, instance_id)
        self.hits_subject = subjects.kv_hits(namespace)
        self.stats = FeedStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: deque[KVEvent] = deque()
        self._hits: deque[AdmittedHit] = deque()
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one publisher at a time: batches leave in id order
        # drained (engine thread only) and published (asyncio only) event counts: their difference is the
        # backlog, read by the hook without a lock since each counter has one writer
        self._drained = 0
        self._sent = 0
        self._last_drain = 0.0

    @property
    def enabled(self) -> bool:
        return self.events_on or self.hits_on

    # --- wiring ---------------------------------------------------------------------------------------

    def attach(self) -> None:
        """Install the step hook (call from the event loop that publishes, with the engine started)."""
        if not self.enabled:
            return
        self._loop = asyncio.get_running_loop()
        if self.hits_on:
            self.engine.core.record_admissions()
        self.engine.set_step_hook(self.on_step)

    def detach(self) -> None:
        self.engine.set_step_hook(None)

    # --- engine thread ----------------------------------------------------------------------------------

    def on_step(self, core: EngineCore, idle: bool) -> None:
        """The step hook: hand what happened since the last drain to the event loop, at most every
        `interval_s` while the engine is busy (batches), at once when it idles (nothing waits for long)."""
        now = time.monotonic()
        if not idle and now - self._last_drain < self.interval_s:
            return
        events: list[KVEvent] = []
        if self.events_on and core.cache.pending_events() and self._drained - self._sent < self.max_queued:
            events = core.cache.drain_events()
        admissions = core.drain_admissions() if self.hits_on else []
        if not events and not admissions:
            return
        self._last_drain = now
        self._handover(events, admissions)

    def _take_snapshot(self, core: EngineCore) -> CacheSnapshot:
        pending, snap = core.cache.snapshot()
        self._handover(pending, [])
        return snap

    def _handover(self, events: list[KVEvent], admissions: list[AdmittedHit]) -> None:
        """Queue for the event loop, in drain order: the engine thread appends, the loop pops from the left
        (both atomic on a deque), so everything drained before a snapshot is queued before its events."""
        self._drained += len(events)
        self._outbox.extend(events)
        self._hits.extend(admissions)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    # --- event loop -------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Publish whatever the hook hands over, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Publish the outbox (in id order) and the hit reports received so far."""
        async with self._lock:
            events = _take_all(self._outbox)
            for batch in event_batches(self.instance_id, self.epoch, events, self.max_batch_blocks):
                await self._send(self.events_subject, batch, len(batch.events))
                self.stats.batches += 1
            self._sent += len(events)
            admissions = _take_all(self._hits)
            for report in hit_reports(self.instance_id, admissions):
                await self._send(self.hits_subject, report, 0)
                self.stats.hit_reports += 1

    async def _send(self, subject: str, msg: BaseModel, num_events: int) -> None:
        try:
            await self.publish(subject, msg)
            self.stats.events += num_events
        except Exception as exc:  # lost events leave a gap the router notices; lost reports cost nothing
            self.stats.failures += 1
            log.warning("KV feed publish failed", extra={"subject": subject, "error": str(exc)})

    async def answer_snapshot(self, _: KVSnapshotRequest, timeout_s: float = 30.0) -> KVSnapshotReply:
        """The cached block set, taken on the engine thread; the events it drained are published first, so
        every event <= its last_event_id went out before the reply and the later ones follow."""
        snap = await self.engine.call(self._take_snapshot, timeout_s=timeout_s)
        await self.flush()  # the outbox holds every event up to the snapshot's, in order
        self.stats.snapshots += 1
        return snapshot_reply(self.instance_id, self.epoch, snap)


def _take_all(q: deque) -> list:
    """Pop everything queued now (the engine thread may append meanwhile: those wait for the next flush)."""
    out = []
    for _ in range(len(q)):
        out.append(q.popleft())
    return out
