"""Service registry on JetStream KV: registration, heartbeats with TTL, listing, watching.

Each instance stores its RegistryEntry under key `<role>.<instance_id>` with a per-message TTL
(`Nats-TTL`, nats-server 2.11+) and re-puts it every heartbeat interval. The server removes an
entry whose last heartbeat is older than its TTL and leaves a delete marker, so watchers see the
leave without any client-side timer; a SIGKILLed process therefore disappears within TTL.
When NATS is clustered the bucket is Raft-replicated (set `replicas`), so there is no home-made
consensus here.
"""

from __future__ import annotations

import asyncio
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
        """Create the bucket if missing (idempotent), with per-message TTL and leave markers."""
        config = KeyValueConfig(bucket=bucket, history=1, replicas=replicas, limit_marker_ttl=_MARKER_TTL_S)
        try:
            kv = await bus.js.create_key_value(config)
        except nats.js.errors.BadRequestError:
            kv = await bus.js.key_value(bucket)  # exists with another config: use it as is
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
        """Live entries (optionally of one role), sorted by key.

        Reads the stream's per-subject state, then the last message of each subject. (A KV watcher's
        initial snapshot can skip an entry that a heartbeat re-puts while the snapshot is taken.)
        """
        pattern = f"{Role(role).value}.*" if role else ">"
        prefix = f"$KV.{self.bucket}."
        try:
            async with asyncio.timeout(timeout):
                info = await self._bus.js.stream_info(f"KV_{self.bucket}", subjects_filter=prefix + pattern)
                found: dict[str, RegistryEntry] = {}
                for subject in sorted(info.state.subjects or {}):
                    key = subject.removeprefix(prefix)
                    try:
                        item = await self._kv.get(key)
                    except nats.js.errors.KeyNotFoundError:  # deleted or expired (a marker is left)
                        continue
                    if item.value and (entry := _decode_entry(key, item.value)) is not None:
                        found[key] = entry
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise TimeoutError(f"listing registry bucket {self.bucket} took over {timeout}s") from exc
        return [found[k] for k in sorted(found)]

    async def watch(self, role: Role | str | None = None, refreshes: bool = False) -> AsyncIterator[RegistryEvent]:
        """Yield JOIN for every live entry (current ones first) and LEAVE when one goes.

        Heartbeat refreshes of a known entry are reported (as UPDATE, with the new entry: its load) only with
        `refreshes`. Runs until cancelled (`libs.bus.view.RegistryView` keeps a local view from it).
        """
        pattern = f"{Role(role).value}.*" if role else ">"
        watcher = await self._kv.watch(pattern)
        known: set[str] = set()
        try:
            async for item in watcher:
                if item is None:  # end of the initial snapshot
                    continue
                event = _to_event(item.key, item.value, item.operation, known, refreshes)
                if event is not None:
                    yield event
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()


def _decode_entry(key: str, value: bytes | None) -> RegistryEntry | None:
    try:
        return decode(value or b"", RegistryEntry)
    except ProtocolError as exc:
        log.warning("ignoring malformed registry entry", extra={"key": key, "error": str(exc)})
        return None


def _to_event(key: str, value: bytes | None, operation: str | None, known: set[str],
              refreshes: bool = False) -> RegistryEvent | None:
    """Pure: turn one KV update into a join/leave (/update with `refreshes`) event, tracking known keys."""
    # An expired entry arrives as a marker with an empty body (nats-py may not name its operation).
    if operation in (KV_DEL, KV_PURGE) or not value:
        if key not in known:
            return None
        known.discard(key)
        return RegistryEvent(RegistryEventKind.LEAVE, key, None)
    if key in known and not refreshes:
        return None  # heartbeat refresh
    entry = _decode_entry(key, value)
    if entry is None:
        return None
    if key in known:
        return RegistryEvent(RegistryEventKind.UPDATE, key, entry)
    known.add(key)
    return RegistryEvent(RegistryEventKind.JOIN, key, entry)


class Registration:
    """Heartbeat loop of one instance's entry."""

    def __init__(self, registry: Registry, entry: RegistryEntry, heartbeat: HeartbeatConfig) -> None:
        self._registry = registry
        self.entry = entry
        self.heartbeat = heartbeat
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Put the entry now (errors propagate: a service that cannot register must not start)."""
        await self._registry.put(self.entry, self.heartbeat.ttl_s)
        self._task = asyncio.create_task(self._loop(), name=f"heartbeat-{self.entry.instance_id}")

    async def _loop(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat.interval_s)
            try:
                await self._registry.put(self.entry, self.heartbeat.ttl_s)
                now = time.monotonic()
                if now - last > self.heartbeat.ttl_s:  # a blocked event loop: routers did not see this instance
                    log.warning("heartbeat late: the entry may have expired meanwhile",
                                extra={"instance": self.entry.instance_id, "gap_s": round(now - last, 3)})
                last = now
            except Exception as exc:  # NATS down: keep trying; the entry expires meanwhile
                log.warning("heartbeat failed", extra={"instance": self.entry.instance_id, "error": repr(exc)})

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if deregister:
            try:
                await self._registry.deregister(self.entry.role, self.entry.instance_id)
            except Exception as exc:  # the TTL removes it anyway
                log.warning("deregister failed", extra={"instance": self.entry.instance_id, "error": repr(exc)})
