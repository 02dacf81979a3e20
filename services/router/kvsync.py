"""Keeping the router's prefix index in step with the workers (the snapshot request is the only IO, injected).

`IndexSync` indexes every worker that joins the registry view with `KV_LAYOUT_LABELS`; the first member
fixes the layout and a worker with another is routed without affinity. Only members' events count; a gap,
a late start, a join or a new epoch marks the worker's view stale and schedules a `KVSnapshotRequest` off
the request path (bounded, retried with backoff), after which the buffered events are replayed. A worker
leaving the view leaves the index at once. With `events=False` the index is an `ApproxIndex` of this
router's own decisions. Details: docs/routing.md, "The router service".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from libs.bus import RegistryEventKind
from libs.routing import ApproxIndex, ClusterPrefixIndex, HitPredictor
from libs.worker import kv_wire
from protos.messages import KVEventBatch, KVSnapshotReply, RegistryEntry
from services.router import handlers, metrics
from services.router.config import RouterConfig
from services.router.handlers import IndexLayout

log = logging.getLogger("windserve.router")

FetchSnapshot = Callable[[str], Awaitable[KVSnapshotReply]]

SWEEP_BATCH = 1 << 15
"""Blocks swept per slice between two event-loop turns (about 30 ms of Python)."""
_NO_INDEX = ApproxIndex(1)  # predicts nothing: no worker has advertised its layout yet


class IndexSync:
    """The router's index and what keeps it right (module docstring)."""

    def __init__(self, config: RouterConfig, fetch: FetchSnapshot) -> None:
        self.config = config
        self.events = config.kv_index
        self._fetch = fetch
        self.layout: IndexLayout | None = None
        self.index: ClusterPrefixIndex | None = None
        self.approx: ApproxIndex | None = None
        self.members: dict[str, IndexLayout] = {}
        self._epochs: dict[str, str] = {}
        self._due: dict[str, float] = {}  # instance -> monotonic time of its next snapshot attempt
        self._backoff: dict[str, float] = {}
        self.gaps = self.snapshot_errors = 0  # since start (health details; the metrics count them too)
        self.wake = asyncio.Event()  # set when a snapshot becomes due

    @property
    def predictor(self) -> HitPredictor:
        """What the affinity cost asks for hits."""
        return self.index or self.approx or _NO_INDEX

    # ------------------------------------------------------------------ registry

    def on_registry(self, kind: RegistryEventKind, entry: RegistryEntry) -> None:
        """The registry view's listener."""
        if entry.role not in handlers.ENGINE_ROLES:
            return
        if kind is RegistryEventKind.JOIN:
            self.join(entry)
        elif kind is RegistryEventKind.LEAVE:
            self.leave(entry.instance_id)

    def join(self, entry: RegistryEntry) -> None:
        iid = entry.instance_id
        try:
            layout = handlers.layout_of(entry)
        except ValueError as exc:
            metrics.LAYOUT_REFUSALS.inc()
            log.warning("worker not indexed", extra={"instance": iid, "error": str(exc)})
            return
        if layout is None:
            log.info("worker advertises no KV layout: routed without affinity", extra={"instance": iid})
            return
        if not self.members and layout != self.layout:
            self._new_index(layout)
        if layout != self.layout:
            metrics.LAYOUT_REFUSALS.inc()
            log.warning("worker not indexed: its KV layout differs from the index's",
                        extra={"instance": iid, "layout": str(layout), "index_layout": str(self.layout)})
            return
        self.members[iid] = layout
        if self.index is not None:
            self._epochs.pop(iid, None)
            self._ask_snapshot(iid)

    def leave(self, iid: str) -> None:
        if self.members.pop(iid, None) is None:
            return
        self._epochs.pop(iid, None)
        self._due.pop(iid, None)
        self._backoff.pop(iid, None)
        if self.index is not None:
            self.index.remove_worker(iid)
        if self.approx is not None:
            self.approx.remove_worker(iid)
        log.info("worker left the index", extra={"instance": iid})

    def _new_index(self, layout: IndexLayout) -> None:
        self.layout = layout
        if self.events:
            self.index = ClusterPrefixIndex(layout.page_size, layout.window, layout.rebuild_tokens,
                                            max_buffered=self.config.max_buffered_events)
        else:
            self.approx = ApproxIndex(layout.page_size, self.config.approx_ttl_s, self.config.approx_max_entries)
        log.info("prefix index created", extra={"layout": str(layout), "kv_events": self.events})

    # ------------------------------------------------------------------ events

    def on_batch(self, batch: KVEventBatch) -> str:
        """Apply one worker's batch; returns the outcome (also counted)."""
        outcome = self._apply(batch)
        metrics.EVENT_BATCHES.labels(outcome).inc()
        return outcome

    def _apply(self, batch: KVEventBatch) -> str:
        iid, index = batch.instance_id, self.index
        if index is None or iid not in self.members:
            return "not_indexed"
        outcome = "applied"
        known = self._epochs.get(iid)
        if known != batch.epoch:
            if known is not None:  # restarted under the same id: its old blocks are gone
                log.info("worker restarted: new KV event epoch", extra={"instance": iid, "epoch": batch.epoch})
                self._restart_view(iid)
                outcome = "new_epoch"
            self._epochs[iid] = batch.epoch
        was_stale = index.is_stale(iid)
        if not index.apply(iid, kv_wire.kv_events(batch)) and not was_stale:
            metrics.EVENT_GAPS.inc()
            self.gaps += 1
            log.info("KV event gap: resyncing", extra={"instance": iid, "expected": index.next_event_id(iid),
                                                      "got": batch.events[0].event_id})
            self._schedule(iid)
            outcome = "gap"
        return outcome

    def _restart_view(self, iid: str) -> None:
        assert self.index is not None
        self.index.remove_worker(iid)
        self._ask_snapshot(iid)

    def _ask_snapshot(self, iid: str) -> None:
        assert self.index is not None
        self.index.mark_stale(iid)
        self._schedule(iid)

    def _schedule(self, iid: str) -> None:
        self._due.setdefault(iid, time.monotonic())
        self.wake.set()

    # ------------------------------------------------------------------ snapshots

    def next_due_in(self) -> float | None:
        """Seconds until the next snapshot attempt (None: none scheduled)."""
        if not self._due:
            return None
        return max(0.0, min(self._due.values()) - time.monotonic())

    async def fetch_due(self, limit: int = 16) -> None:
        """Ask the workers whose snapshot is due (at most `limit` at once, concurrently)."""
        self.wake.clear()
        if self.index is not None:  # a stale view nobody scheduled (defensive: every path schedules)
            for iid in self.index.stale_workers():
                if iid in self.members:
                    self._due.setdefault(iid, time.monotonic())
        now = time.monotonic()
        due = sorted((t, i) for i, t in self._due.items() if t <= now)[:limit]
        if due:
            await asyncio.gather(*(self._fetch_one(iid) for _, iid in due))

    async def _fetch_one(self, iid: str) -> None:
        try:
            reply = await self._fetch(iid)
        except Exception as exc:
            metrics.SNAPSHOT_RESYNCS.labels("error").inc()
            self.snapshot_errors += 1
            delay = self._backoff[iid] = min(2 * self._backoff.get(iid, self.config.snapshot_retry_s / 2),
                                             self.config.snapshot_retry_max_s)
            if iid in self._due:
                self._due[iid] = time.monotonic() + delay
            log.warning("KV snapshot request failed", extra={"instance": iid, "error": repr(exc), "retry_s": delay})
            return
        self.load(iid, reply)

    def load(self, iid: str, reply: KVSnapshotReply) -> bool:
        """Load a worker's snapshot reply; True when its view is in sync after it."""
        index = self.index
        if index is None or iid not in self.members or iid not in self._due:
            return False  # left (or re-joined and asked again) meanwhile
        known = self._epochs.get(iid)
        if known is not None and known != reply.epoch:  # events buffered from another process: drop them
            index.remove_worker(iid)
        self._epochs[iid] = reply.epoch
        if index.load_snapshot(iid, kv_wire.routing_snapshot(reply)):
            del self._due[iid]
            self._backoff.pop(iid, None)
            metrics.SNAPSHOT_RESYNCS.labels("ok").inc()
            return True
        metrics.SNAPSHOT_RESYNCS.labels("behind").inc()  # the buffered events do not continue it: ask again
        self._due[iid] = time.monotonic() + self.config.snapshot_retry_s
        return False

    # ------------------------------------------------------------------ decisions and upkeep

    def record(self, workers: Sequence[str], block_hashes: Sequence[int], now: float) -> None:
        """Approximate mode: the chain was routed to these workers."""
        if self.approx is not None and block_hashes:
            for w in dict.fromkeys(workers):
                if w in self.members:
                    self.approx.record(w, block_hashes, now)

    def expire(self, now: float) -> None:
        if self.approx is not None:
            self.approx.expire(now)

    async def maintain(self, measure: bool = False) -> None:
        """Sweep retired slots and refresh the index gauges (`measure`: the O(blocks) byte count too). The
        sweep gives the event loop back every `SWEEP_BATCH` blocks: decisions and events go on meanwhile."""
        index = self.index
        if index is not None:
            if index.needs_sweep:
                for _ in index.sweep_steps(SWEEP_BATCH):
                    await asyncio.sleep(0)
            metrics.INDEX_BLOCKS.set(len(index))
            metrics.INDEX_ENTRIES.set(index.entries())
            metrics.STALE_WORKERS.set(len(index.stale_workers()))
            if measure:
                metrics.INDEX_BYTES.set(index.memory_bytes())
        elif self.approx is not None:
            metrics.INDEX_BLOCKS.set(len(self.approx))
            metrics.INDEX_ENTRIES.set(self.approx.entries())
        metrics.INDEX_WORKERS.set(len(self.members))

    def details(self) -> dict[str, str]:
        """Health fields: indexed workers, stale ones, blocks, event gaps and failed snapshot requests so far."""
        stale = self.index.stale_workers() if self.index is not None else []
        blocks = len(self.index) if self.index is not None else len(self.approx) if self.approx is not None else 0
        return {"kv_workers": str(len(self.members)), "kv_stale": str(len(stale)), "kv_blocks": str(blocks),
                "kv_gaps": str(self.gaps), "kv_snapshot_errors": str(self.snapshot_errors)}
