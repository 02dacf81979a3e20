"""A local view of the service registry, kept by its watcher: readers ask a dict, never the store.

    view = RegistryView(registry)
    view.add_listener(on_change)            # (JOIN | LEAVE, entry): a worker came or went
    await view.start()                      # one listing (bounded), then the watch keeps it
    view.live(time.time())                  # the fresh entries, sorted by key
    await view.stop()

Promises: listings resync the watch (at start, after a watch error, every `resync_interval_s`); only fresh
entries are live, so a dead instance leaves within its TTL (+ `slack_s`); an entry is dropped for its age
only if the store has no fresher heartbeat; time this process could not write heartbeats (`outages`) does
not age entries, up to `outage_keep_s`. Every wait is bounded; listeners run in the view's task and must
not block. Rules: docs/reliability.md, "Registry freshness rule" and "A NATS node dies: the registry's
election".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import nats.errors

from libs.bus.errors import BusError
from libs.bus.registry import Registry, RegistryEvent, RegistryEventKind, entry_key
from protos.messages import RegistryEntry, Role

log = logging.getLogger("windserve.registry")

ViewListener = Callable[[RegistryEventKind, RegistryEntry], None]
"""Called with (JOIN, the new entry) or (LEAVE, the last entry seen of the instance that went)."""
Outages = Callable[[], Sequence[tuple[float, float | None]]]
"""(start, end) unix times in which the registry could not be written (end None: still failing)."""


@dataclass(frozen=True)
class ViewConfig:
    list_timeout_s: float = 2.0
    """Most time one listing may take."""
    retry_s: float = 0.5
    """Wait before restarting a failed watch; doubles per failure in a row, up to `retry_max_s`."""
    retry_max_s: float = 10.0
    prune_interval_s: float = 0.5
    """How often entries past their TTL are dropped."""
    resync_interval_s: float = 60.0
    """A full listing this often besides the watch (0 = only at start and after watch errors)."""
    slack_s: float = 1.0
    """Clock skew allowed on an entry's freshness (`RegistryEntry.fresh`)."""
    outage_keep_s: float = 15.0
    """Most registry-unwritable time not counted against an entry's age (module docstring)."""
    stale_check_s: float = 1.0
    """Before entries are dropped for their age, the store is listed if the last listing is older than this
    (a stalled watch: module docstring)."""

    def __post_init__(self) -> None:
        if min(self.list_timeout_s, self.retry_s, self.retry_max_s, self.prune_interval_s, self.stale_check_s,
               self.outage_keep_s) <= 0:
            raise ValueError("ViewConfig: timeouts and intervals must be > 0")
        if self.resync_interval_s < 0 or self.slack_s < 0:
            raise ValueError("ViewConfig: resync_interval_s and slack_s must be >= 0")


class RegistryView:
    """The registry's entries (of one role, or all) as a local dict kept by the watcher (module docstring)."""

    def __init__(self, registry: Registry, role: Role | None = None, config: ViewConfig | None = None,
                 outages: Outages | None = None) -> None:
        self._registry = registry
        self._outages = outages
        self._role = role
        self.config = config or ViewConfig()
        self._entries: dict[str, RegistryEntry] = {}
        self._version = 0  # bumped by every change; `_changed[key]` = the version of the key's last change
        self._changed: dict[str, int] = {}
        self._listeners: list[ViewListener] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()  # one listing at a time
        self._listed_at = float("-inf")  # monotonic time of the last successful listing
        self.resyncs = 0
        """Successful listings (start, watch errors, periodic, `resync_if_older`)."""
        self.watch_errors = 0
        self.watch_stalls = 0
        """Listings that found fresher heartbeats than the watch had delivered (the watch was restarted)."""
        self._rescued = 0  # entries the last listing found fresh that the view held stale

    # ------------------------------------------------------------------ reading

    @property
    def listing(self) -> bool:
        """A listing of the store is in flight."""
        return self._lock.locked()

    def add_listener(self, listener: ViewListener) -> None:
        self._listeners.append(listener)

    def entries(self) -> list[RegistryEntry]:
        """Every entry held, sorted by key (fresh or not: `live` filters)."""
        return [self._entries[k] for k in sorted(self._entries)]

    def live(self, now: float, role: Role | None = None) -> list[RegistryEntry]:
        """The entries fresh at unix time `now` (optionally of one role), sorted by key; the time the registry
        could not be written is not counted against their age (module docstring)."""
        windows = self._windows()
        return [e for e in self.entries() if (role is None or e.role is role) and self._fresh(e, now, windows)]

    def _windows(self) -> Sequence[tuple[float, float | None]]:
        """The registry's unwritable windows (read once per call over all entries: `live` is on the router's
        request path)."""
        return self._outages() if self._outages is not None else ()

    def _fresh(self, entry: RegistryEntry, now: float, windows: Sequence[tuple[float, float | None]]) -> bool:
        """`entry.fresh` with the time in `windows` since its heartbeat not counted, at most `outage_keep_s`."""
        since = entry.heartbeat_at
        unwritable = sum(max(0.0, (now if end is None else min(now, end)) - max(since, start))
                         for start, end in windows)
        return entry.fresh(now - min(unwritable, self.config.outage_keep_s), self.config.slack_s)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> bool:
        """List once (bounded), then keep the view by the watch. False when that first listing failed (the
        watch fills the view anyway, and the next resync retries)."""
        ok = await self.resync()
        self._tasks = [self._start_watch(), asyncio.create_task(self._maintain_loop(), name="registry-view-maintain")]
        return ok

    def _start_watch(self) -> asyncio.Task[None]:
        return asyncio.create_task(self._watch_loop(), name="registry-view-watch")

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)  # bounded; a cancelled task raises nothing here

    async def resync(self) -> bool:
        """One listing merged into the view (JOIN / LEAVE for what it finds changed); keys the watch changed
        meanwhile keep the watch's version. False (logged) when the listing failed or timed out."""
        async with self._lock:
            before = self._version
            try:
                listed = await self._registry.list(self._role, timeout=self.config.list_timeout_s)
            except (TimeoutError, BusError, nats.errors.Error) as exc:
                log.warning("registry listing failed", extra={"bucket": self._registry.bucket, "error": repr(exc)})
                return False
            found = {entry_key(e.role, e.instance_id): e for e in listed}
            untouched = [k for k in {*found, *self._entries} if self._changed.get(k, -1) <= before]
            now = time.time()
            self._rescued = sum(1 for k in untouched if k in found and k in self._entries
                                and not self._entries[k].fresh(now, self.config.slack_s)
                                and found[k].fresh(now, self.config.slack_s))
            for key in untouched:
                if key in found:
                    self._put(key, found[key])
                elif self._entries[key].fresh(now, self.config.slack_s):
                    self._drop(key)  # gone from the store while fresh: deregistered (past its TTL: `prune` judges)
            self._changed = {k: v for k, v in self._changed.items() if k in self._entries or v > before}
            self._listed_at = time.monotonic()
            self.resyncs += 1
            return True

    async def resync_if_older(self, age_s: float) -> bool:
        """Resync when the last listing is older than `age_s` (a reader that found nothing it needs: the
        watch may not have delivered a join yet). False when no listing ran or it failed."""
        if time.monotonic() - self._listed_at < age_s:
            return False
        return await self.resync()

    def prune(self, now: float) -> None:
        """Drop the entries past their TTL at unix time `now` (LEAVE for each)."""
        windows = self._windows()
        for key in [k for k, e in self._entries.items() if not self._fresh(e, now, windows)]:
            self._drop(key)

    def _expired(self, now: float) -> bool:
        return any(not e.fresh(now, self.config.slack_s) for e in self._entries.values())

    async def check_expired(self) -> None:
        """Prune, after listing the store first when entries are about to be dropped for their age (a stalled
        watch would otherwise make live instances leave); a listing that rescues any restarts the watch."""
        if self._expired(time.time()) and await self.resync_if_older(self.config.stale_check_s) and self._rescued:
            self.watch_stalls += 1
            log.warning("registry watch missed heartbeats; restarting it",
                        extra={"bucket": self._registry.bucket, "rescued": self._rescued})
            if self._tasks:
                self._tasks[0].cancel()
                self._tasks[0] = self._start_watch()
        self.prune(time.time())

    # ------------------------------------------------------------------ internals

    async def _watch_loop(self) -> None:
        delay = self.config.retry_s
        while True:
            try:
                async for event in self._registry.watch(self._role, refreshes=True):
                    self._on_event(event)
                    delay = self.config.retry_s
                log.warning("registry watch ended; restarting", extra={"bucket": self._registry.bucket})
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.watch_errors += 1
                log.warning("registry watch failed; restarting", extra={"bucket": self._registry.bucket,
                                                                       "error": repr(exc), "retry_s": delay})
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.config.retry_max_s)
            await self.resync()

    async def _maintain_loop(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.prune_interval_s)
            await self.check_expired()
            if cfg.resync_interval_s:
                await self.resync_if_older(cfg.resync_interval_s)

    def _on_event(self, event: RegistryEvent) -> None:
        if event.kind is RegistryEventKind.LEAVE:
            held = self._entries.get(event.key)
            if event.expired or (held is not None and not held.fresh(time.time(), self.config.slack_s)):
                # the store's TTL expiry, the watch's age sweep, a listing's reap of an entry past its TTL: ages
                # are judged here (`check_expired`: a stalled watch, outages)
                return
            self._drop(event.key)  # a deregistration: at once
        elif event.entry is not None:
            self._put(event.key, event.entry)

    def _put(self, key: str, entry: RegistryEntry) -> None:
        if not self._fresh(entry, time.time(), self._windows()):
            return  # a stale entry the store kept (a persisted store across restarts): never a join
        self._touch(key)
        old = self._entries.get(key)
        self._entries[key] = entry
        if old is not None and old.started_at != entry.started_at:
            self._notify(RegistryEventKind.LEAVE, old)  # restarted under the same id before its TTL ran out
            old = None
        if old is None:
            self._notify(RegistryEventKind.JOIN, entry)

    def _drop(self, key: str) -> None:
        self._touch(key)
        old = self._entries.pop(key, None)
        if old is not None:
            self._notify(RegistryEventKind.LEAVE, old)

    def _touch(self, key: str) -> None:
        self._version += 1
        self._changed[key] = self._version

    def _notify(self, kind: RegistryEventKind, entry: RegistryEntry) -> None:
        for listener in self._listeners:
            try:
                listener(kind, entry)
            except Exception:
                log.exception("registry view listener failed", extra={"instance": entry.instance_id})
