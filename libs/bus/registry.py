"""Service registry on JetStream KV: registration, heartbeats with TTL, listing, watching.

Each instance stores its RegistryEntry under key `<role>.<instance_id>` with a per-message TTL
(`Nats-TTL`, nats-server 2.11+) and re-puts it every heartbeat interval. The server removes an
entry whose last heartbeat is older than its TTL and leaves a delete marker, so watchers see the
leave without any client-side timer; a SIGKILLed process therefore disappears within TTL.

Freshness rule: the store's expiry is not trusted alone. A nats-server killed with SIGKILL and restarted
on its persisted store brings back entries it had already expired and removed (the removal was not yet
on disk), and the issue #14 run saw such ghosts stay. So every entry carries its heartbeat time and TTL
(stamped by `put`), and `list` and `watch` trust an entry only while `RegistryEntry.fresh` holds,
whatever the store says (docs/reliability.md). Consumers of `list` / `watch` need no filter of their own.
When NATS is clustered the bucket is Raft-replicated (set `replicas`), so there is no home-made
consensus here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from libs.bus.bus import Bus
from protos import subjects
from protos.base import ProtocolError, decode, encode
from protos.messages import RegistryEntry, Role

log = logging.getLogger("windserve.registry")

_MARKER_TTL_S = 1.0  # how long the server keeps a leave marker (watchers read it immediately)
WATCH_SWEEP_S = 1.0  # how often `watch` checks known entries' freshness when no update arrives


@dataclass(frozen=True)
class HeartbeatConfig:
    """TTL is whole seconds because NATS per-message TTL has second granularity."""

    ttl_s: int = 5
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.ttl_s < 1:
            raise ValueError(f"registry ttl_s must be >= 1, got {self.ttl_s}")
        if not 0 < self.interval_s < self.ttl_s:
            raise ValueError(
                f"heartbeat interval_s ({self.interval_s}) must be > 0 and < ttl_s ({self.ttl_s}), "
                "otherwise a live instance would expire between heartbeats"
            )


class RegistryEventKind(StrEnum):
    JOIN = "join"
    LEAVE = "leave"
    UPDATE = "update"  # a heartbeat re-put of a known entry (fresh load); only from `watch(refreshes=True)`


@dataclass(frozen=True)
class RegistryEvent:
    kind: RegistryEventKind
    key: str
    entry: RegistryEntry | None  # None for a leave
    expired: bool = False  # a LEAVE for the entry's age (the store's TTL expiry, or the watch's sweep)


def entry_key(role: Role | str, instance_id: str) -> str:
    return f"{Role(role).value}.{subjects.token(instance_id)}"


class Registry:
    """Registry bound to one bucket. Open with `await Registry.open(bus)`."""

    def __init__(self, bus: Bus, kv: KeyValue, bucket: str) -> None:
        self._bus = bus
        self._kv = kv
        self.bucket = bucket

    @classmethod
    async def open(cls, bus: Bus, bucket: str = subjects.registry_bucket(subjects.DEFAULT_NAMESPACE),
                   replicas: int = 1) -> Registry:
        """Create the bucket if missing (idempotent), with per-message TTL and leave markers. A bucket that exists
        with fewer than `replicas` replicas (created earlier at R1, e.g. before the deployment was clustered) is
        scaled up to `replicas`; one with more is left as it is (a service without WINDSERVE_NATS_REPLICAS asks
        for 1 and must not scale a cluster's bucket down)."""
        config = KeyValueConfig(bucket=bucket, history=1, replicas=replicas, limit_marker_ttl=_MARKER_TTL_S)
        try:
            kv = await bus.js.create_key_value(config)
        except nats.js.errors.BadRequestError:
            kv = await bus.js.key_value(bucket)  # exists with another config: use it (replicas raised below)
            try:
                await bus.ensure_replicas(f"KV_{bucket}", replicas)
            except nats.js.errors.Error as exc:  # (e.g. fewer servers than replicas): serve with it as it is
                log.warning("registry bucket replicas not raised", extra={"bucket": bucket, "replicas": replicas,
                                                                          "error": repr(exc)})
        return cls(bus, kv, bucket)

    async def put(self, entry: RegistryEntry, ttl_s: int) -> None:
        """Store (or refresh) an entry that expires `ttl_s` seconds after this call (stamped with this
        time and TTL, so a consumer can tell a stale entry: `RegistryEntry.fresh`)."""
        entry = entry.model_copy(update={"heartbeat_at": time.time(), "ttl_s": ttl_s})
        key = entry_key(entry.role, entry.instance_id)
        await self._bus.js.publish(f"$KV.{self.bucket}.{key}", encode(entry), msg_ttl=ttl_s)

    async def deregister(self, role: Role | str, instance_id: str) -> None:
        await self._kv.delete(entry_key(role, instance_id))

    def register(self, entry: RegistryEntry, heartbeat: HeartbeatConfig) -> Registration:
        """Start heartbeating `entry`. Call `await reg.start()` then `await reg.stop()`."""
        return Registration(self, entry, heartbeat)

    async def list(self, role: Role | str | None = None, timeout: float = 5.0) -> list[RegistryEntry]:
        """Live entries (optionally of one role), sorted by key: stored and fresh (module docstring).

        Reads the stream's per-subject state, then the last message of each subject. (A KV watcher's
        initial snapshot can skip an entry that a heartbeat re-puts while the snapshot is taken.)
        A stale entry found on the way is also removed from the store (`_reap`).
        """
        pattern = f"{Role(role).value}.*" if role else ">"
        prefix = f"$KV.{self.bucket}."
        try:
            async with asyncio.timeout(timeout):
                info = await self._bus.js.stream_info(f"KV_{self.bucket}", subjects_filter=prefix + pattern)
                found: dict[str, tuple[RegistryEntry, int]] = {}
                for subject in sorted(info.state.subjects or {}):
                    key = subject.removeprefix(prefix)
                    try:
                        item = await self._kv.get(key)
                    except nats.js.errors.KeyNotFoundError:  # deleted or expired (a marker is left)
                        continue
                    if item.value and (entry := _decode_entry(key, item.value)) is not None:
                        found[key] = (entry, item.revision or 0)
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise TimeoutError(f"listing registry bucket {self.bucket} took over {timeout}s") from exc
        now = time.time()
        for key, (entry, revision) in found.items():
            if not entry.fresh(now):
                await self._reap(key, revision, now - entry.heartbeat_at)
        return fresh_only([found[k][0] for k in sorted(found)], now)

    async def _reap(self, key: str, revision: int, age_s: float) -> None:
        """Best effort: delete a stale entry so it stops costing every listing. nats-server 2.15 brings back
        an entry it expired before a SIGKILL and then never expires it again (docs/reliability.md). The
        delete names the stale revision, so it cannot remove a heartbeat that lands meanwhile, and its
        marker expires like an expiry's."""
        headers = {"KV-Operation": KV_DEL, "Nats-Expected-Last-Subject-Sequence": str(revision)}
        try:
            await self._bus.js.publish(f"$KV.{self.bucket}.{key}", b"", headers=headers, msg_ttl=_MARKER_TTL_S)
            log.info("removed a stale registry entry", extra={"key": key, "age_s": round(age_s, 1)})
        except Exception as exc:  # refreshed meanwhile (wrong last sequence) or NATS busy: listing still ignores it
            log.debug("could not remove a stale registry entry", extra={"key": key, "error": repr(exc)})

    async def purge(self) -> int:
        """Remove every entry, live or not, and the delete markers of entries already removed; returns how many
        entries were still there (left by instances that never deregistered: killed, or a lost host). Only for an
        owner that knows no instance of this bucket runs (`make run` before it starts any service)."""
        try:
            left = len(await self._kv.keys())  # entries only: a clean stop leaves delete markers, no keys
        except nats.js.errors.NoKeysError:
            left = 0
        await self._bus.js.purge_stream(f"KV_{self.bucket}")
        return left

    async def watch(self, role: Role | str | None = None, refreshes: bool = False, sweep_s: float = WATCH_SWEEP_S
                    ) -> AsyncIterator[RegistryEvent]:
        """Yield JOIN for every live entry (current ones first) and LEAVE when one goes.

        An entry goes when it is deleted, expires in the store, or stops being fresh: at least every
        `sweep_s` seconds the known entries are checked against the clock, so an entry whose instance
        stopped heartbeating yields LEAVE within about ttl + slack + sweep_s even if the store never
        expires it. A stale entry (a ghost brought back by a restarted server) never yields JOIN.
        Heartbeat refreshes of a known entry are reported (as UPDATE, with the new entry: its load) only with
        `refreshes`. Runs until cancelled (`libs.bus.view.RegistryView` keeps a local view from it).
        """
        if sweep_s <= 0:
            raise ValueError(f"sweep_s must be > 0, got {sweep_s}")
        pattern = f"{Role(role).value}.*" if role else ">"
        watcher = await self._kv.watch(pattern)
        state = WatchState(refreshes)
        try:
            while True:
                try:
                    async with asyncio.timeout(sweep_s):
                        item = await anext(watcher)
                except TimeoutError:
                    item = None  # no update for sweep_s: only the freshness check below
                except StopAsyncIteration:
                    return
                now = time.time()
                if item is not None:  # None also marks the end of the initial snapshot
                    event = state.update(item.key, item.value, item.operation, now)
                    if event is not None:
                        yield event
                for event in state.sweep(now):
                    yield event
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()


def fresh_only(entries: list[RegistryEntry], now: float) -> list[RegistryEntry]:
    """Pure: the entries still fresh at unix time `now` (a stale one is logged: it is a ghost)."""
    kept = [e for e in entries if e.fresh(now)]
    if len(kept) < len(entries):
        stale = sorted(e.instance_id for e in entries if not e.fresh(now))
        log.debug("ignoring stale registry entries", extra={"instances": stale})
    return kept


def _decode_entry(key: str, value: bytes | None) -> RegistryEntry | None:
    try:
        return decode(value or b"", RegistryEntry)
    except ProtocolError as exc:
        log.warning("ignoring malformed registry entry", extra={"key": key, "error": str(exc)})
        return None


class WatchState:
    """Pure core of `Registry.watch`: turns KV updates and the clock into join/leave (/update with
    `refreshes`) events. `known` holds the last fresh entry of every key reported as joined."""

    def __init__(self, refreshes: bool = False) -> None:
        self.refreshes = refreshes
        self.known: dict[str, RegistryEntry] = {}

    def update(self, key: str, value: bytes | None, operation: str | None, now: float) -> RegistryEvent | None:
        # An expired entry arrives as a marker with an empty body (nats-py may not name its operation).
        if operation == KV_DEL:
            return self._leave(key)  # a deregistration (or a listing's reap of an entry past its TTL)
        if operation == KV_PURGE or not value:
            return self._leave(key, expired=True)  # the store's TTL expiry
        entry = _decode_entry(key, value)
        if entry is None:
            return None  # malformed: ignored, the key keeps its state
        if not entry.fresh(now):
            return self._leave(key, expired=True)  # a ghost brought back by the store counts as gone
        joined = key not in self.known
        self.known[key] = entry  # a heartbeat refresh moves the freshness deadline
        if joined:
            return RegistryEvent(RegistryEventKind.JOIN, key, entry)
        return RegistryEvent(RegistryEventKind.UPDATE, key, entry) if self.refreshes else None

    def sweep(self, now: float) -> list[RegistryEvent]:
        """LEAVE for every known entry that is no longer fresh at `now`."""
        stale = [key for key, entry in self.known.items() if not entry.fresh(now)]
        return [event for key in stale if (event := self._leave(key, expired=True)) is not None]

    def _leave(self, key: str, expired: bool = False) -> RegistryEvent | None:
        if self.known.pop(key, None) is None:
            return None
        return RegistryEvent(RegistryEventKind.LEAVE, key, None, expired)


class Registration:
    """Heartbeat loop of one instance's entry.

    Stopping does not rely on task cancellation alone: on Python 3.11 `asyncio.wait_for` (inside nats-py's
    request) returns its result and drops a cancellation that arrives as the publish ack lands, so a
    cancelled heartbeat could go on re-putting the entry (it never left the registry) and `stop` could wait
    for it forever. The loop checks a stop flag before every put, and `stop` waits a bounded time."""

    STOP_TIMEOUT_S = 5.0

    def __init__(self, registry: Registry, entry: RegistryEntry, heartbeat: HeartbeatConfig) -> None:
        self._registry = registry
        self.entry = entry
        self.heartbeat = heartbeat
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._put_at = 0.0  # unix time of the last put that succeeded
        self._put_started: float | None = None  # unix time the put in flight began
        self._down_since: float | None = None  # puts fail since the last success at this time
        self._outages: collections.deque[tuple[float, float]] = collections.deque(maxlen=8)

    def unwritable(self) -> list[tuple[float, float | None]]:
        """The recent windows (unix times) in which this instance's heartbeats could not be written: from the
        last put that succeeded to the next one (end None: still failing). Nobody's heartbeat could be stored
        then, so a reader need not count that time against other entries' ages (`RegistryView`'s outages)."""
        down_since = self._down_since
        if down_since is None and self._put_started is not None and \
                time.time() - self._put_started > self.heartbeat.interval_s:
            down_since = self._put_at  # a put pending longer than a heartbeat interval: not (yet) stored either
        ongoing = [] if down_since is None else [(down_since, None)]
        return [*self._outages, *ongoing]

    def _put_done(self, ok: bool) -> None:
        self._put_started = None
        if not ok:
            if self._down_since is None:
                self._down_since = self._put_at
            return
        now = time.time()
        if self._down_since is not None:
            self._outages.append((self._down_since, now))
            self._down_since = None
        self._put_at = now

    async def start(self) -> None:
        """Put the entry now (errors propagate: a service that cannot register must not start)."""
        self._stopping.clear()
        await self._registry.put(self.entry, self.heartbeat.ttl_s)
        self._put_done(True)
        self._task = asyncio.create_task(self._loop(), name=f"heartbeat-{self.entry.instance_id}")

    async def _loop(self) -> None:
        last = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat.interval_s):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return  # never a put after stop() began: a late put would bring the entry back
            try:
                self._put_started = time.time()
                await self._registry.put(self.entry, self.heartbeat.ttl_s)
                self._put_done(True)
                now = time.monotonic()
                if now - last > self.heartbeat.ttl_s:  # a blocked event loop: routers did not see this instance
                    log.warning("heartbeat late: the entry may have expired meanwhile",
                                extra={"instance": self.entry.instance_id, "gap_s": round(now - last, 3)})
                last = now
            except Exception as exc:  # NATS down: keep trying; the entry expires meanwhile
                self._put_done(False)
                log.warning("heartbeat failed", extra={"instance": self.entry.instance_id, "error": repr(exc)})

    async def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating (bounded: `STOP_TIMEOUT_S`), then delete the entry unless `deregister` is False.
        A put in flight is published before the delete (one connection keeps the order)."""
        self._stopping.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=self.STOP_TIMEOUT_S)
            if not done:  # cannot happen unless a put hangs past its own timeout: say so, do not wait forever
                log.error("heartbeat did not stop in time", extra={"instance": self.entry.instance_id})
            elif not task.cancelled() and task.exception() is not None:
                log.warning("heartbeat ended with an error",
                            extra={"instance": self.entry.instance_id, "error": repr(task.exception())})
        if deregister:
            try:
                await self._registry.deregister(self.entry.role, self.entry.instance_id)
            except Exception as exc:  # the TTL removes it anyway
                log.warning("deregister failed", extra={"instance": self.entry.instance_id, "error": repr(exc)})
