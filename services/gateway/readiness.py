"""Readiness: does the registry hold a complete serving path? (docs/reliability.md)

A path is complete with one fresh combined worker (the gateway reaches it even without a router), or
with a fresh router, prefill worker and decode worker that has a KV transfer address (the gateway
reaches prefill and decode only through the router's pick). The path has *room* while such a path's workers
have KV pages left in both pools by their last load report (`/health/ready?capacity=1` answers 503 without
room). `serving_path` is pure; `CachedListing`
keeps probes (compose healthchecks, Kubernetes, load balancers polling every second) from each
costing a registry scan.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from protos.messages import RegistryEntry, Role

ListEntries = Callable[[], Awaitable[list[RegistryEntry]]]


@dataclass(frozen=True)
class Readiness:
    ready: bool
    missing: tuple[str, ...] = ()  # what the disaggregated path lacks (when there is no combined worker)
    room: bool = True  # a complete path whose workers have KV pages left (their last load reports)
    saturated: tuple[str, ...] = ()  # instances of the path with no pages left (when there is no room)

    @property
    def full_reason(self) -> str:
        """One sentence saying that every path is full (empty while there is room)."""
        if self.room:
            return ""
        return (f"every serving path is full: no KV pages left on {', '.join(self.saturated)} (requests wait for "
                "room, bounded, then get 503)")

    @property
    def reason(self) -> str:
        """One sentence naming what is missing (empty when ready)."""
        if self.ready:
            return ""
        return ("no complete serving path is registered: no combined worker, and the disaggregated path "
                f"lacks {', '.join(self.missing)} (still starting or loading the model?)")


def serving_path(entries: Iterable[RegistryEntry], now: float) -> Readiness:
    """Pure: whether the fresh entries at unix time `now` form a complete serving path."""
    fresh = [e for e in entries if e.fresh(now)]
    roles = {e.role for e in fresh}
    workers = [e for e in fresh if e.role == Role.WORKER]
    prefills = [e for e in fresh if e.role == Role.PREFILL]
    decodes = [e for e in fresh if e.role == Role.DECODE and e.address]
    disagg_room = any(map(has_room, prefills)) and any(map(has_room, decodes))
    if workers:
        room = any(map(has_room, workers)) or (Role.ROUTER in roles and disagg_room)
        return Readiness(True, room=room, saturated=() if room else _full(workers + prefills + decodes))
    missing = []
    if Role.ROUTER not in roles:
        missing.append("a router")
    if not prefills:
        missing.append("a prefill worker")
    if not decodes:
        missing.append("a decode worker with a KV transfer address")
    if missing:
        return Readiness(False, tuple(missing))
    return Readiness(True, room=disagg_room, saturated=() if disagg_room else _full(prefills + decodes))


def has_room(entry: RegistryEntry) -> bool:
    """Pure: KV left by the instance's last load report (no report: assumed): units of its one arena, else
    pages in both pools."""
    load = entry.load
    if load is None:
        return True
    if load.kv_units_total:
        return load.kv_units_used < load.kv_units_total
    return all(total == 0 or used < total
               for used, total in ((load.kv_full_used, load.kv_full_total), (load.kv_swa_used, load.kv_swa_total)))


def _full(entries: list[RegistryEntry]) -> tuple[str, ...]:
    return tuple(e.instance_id for e in entries if not has_room(e))


class CachedListing:
    """The registry's listing for the gateway's readiness probes and its backend, so they share their reads.

    A listing at most `max_age_s` old is served as it is; an older one is read again first (concurrent callers
    share the read), except for `wait=False` callers (advisory reads on the request path), who get the last
    listing (up to `stale_ok_s` old) at once while a background read refreshes it; so do all callers while
    the last read failed. `fresh` always reads. Consumers judge each entry by its own heartbeat, so an old
    listing never keeps a dead instance alive past its TTL. A failure with no listing to fall back on is
    raised and not cached.
    """

    def __init__(self, list_entries: ListEntries, max_age_s: float = 0.5, stale_ok_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_age_s < 0 or stale_ok_s < 0:
            raise ValueError(f"max_age_s and stale_ok_s must be >= 0, got {max_age_s}, {stale_ok_s}")
        self._list = list_entries
        self._max_age_s = max_age_s
        self._stale_ok_s = stale_ok_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._entries: list[RegistryEntry] = []
        self._read_at: float | None = None  # clock time of the last good read
        self._failing = False  # the last read failed
        self._tried_at = float("-inf")  # clock time the last read began
        self._background: asyncio.Task[None] | None = None
        self.served_stale = 0
        """Calls answered with a listing older than `max_age_s` (a background read in flight, or failing)."""

    async def __call__(self, fresh: bool = False, wait: bool = True) -> list[RegistryEntry]:
        """The entries (class docstring); `fresh`: read now, unless the registry is failing; `wait=False`:
        never wait for a read while a listing at most `stale_ok_s` old exists."""
        served = self._served(fresh, wait)
        if served is not None:
            return served
        async with self._lock:
            served = self._served(fresh, wait)  # (a read finished or failed while this call waited)
            if served is not None:
                return served
            try:
                await self._read()
            except Exception:
                if not self._usable(self._stale_ok_s):
                    raise
                self.served_stale += 1
            return list(self._entries)

    def _served(self, fresh: bool, wait: bool) -> list[RegistryEntry] | None:
        """The listing this call gets without waiting, or None when it must read."""
        if self._failing and self._usable(self._stale_ok_s):
            return self._stale()
        if fresh:
            return None
        if self._usable(self._max_age_s):
            return list(self._entries)
        return self._stale() if not wait and self._usable(self._stale_ok_s) else None

    async def _read(self) -> None:
        self._tried_at = self._clock()
        try:
            entries = await self._list()
        except BaseException:  # (also a caller's own time bound cancelling the read)
            self._failing = True
            raise
        self._entries, self._read_at, self._failing = entries, self._clock(), False

    def _stale(self) -> list[RegistryEntry]:
        self._refresh_in_background()
        self.served_stale += 1
        return list(self._entries)

    def _usable(self, max_age_s: float) -> bool:
        return self._read_at is not None and self._clock() - self._read_at <= max_age_s

    def _refresh_in_background(self) -> None:
        if (self._background is not None and not self._background.done()) or \
                self._clock() - self._tried_at < self._max_age_s:
            return

        async def refresh() -> None:
            async with self._lock:
                if self._failing or not self._usable(self._max_age_s):
                    with contextlib.suppress(Exception):
                        await self._read()

        self._background = asyncio.create_task(refresh(), name="registry-listing-refresh")
