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
    """Pure: KV pages left in both pools by the instance's last load report (no report: assumed)."""
    load = entry.load
    if load is None:
        return True
    return all(total == 0 or used < total
               for used, total in ((load.kv_full_used, load.kv_full_total), (load.kv_swa_used, load.kv_swa_total)))


def _full(entries: list[RegistryEntry]) -> tuple[str, ...]:
    return tuple(e.instance_id for e in entries if not has_room(e))


class CachedListing:
    """`list_entries()` reused for `max_age_s` seconds; concurrent callers share one registry read.
    A failed read is not cached (the next probe tries again). One instance serves the gateway's readiness
    probes and its backend (size checks, chain layout, fallbacks), so they share their reads."""

    def __init__(self, list_entries: ListEntries, max_age_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_age_s < 0:
            raise ValueError(f"max_age_s must be >= 0, got {max_age_s}")
        self._list = list_entries
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._entries: list[RegistryEntry] = []
        self._read_at: float | None = None

    async def __call__(self, fresh: bool = False) -> list[RegistryEntry]:
        """The entries, read again when older than `max_age_s` or when `fresh` (after a failure)."""
        async with self._lock:
            if fresh or self._read_at is None or self._clock() - self._read_at > self._max_age_s:
                self._entries = await self._list()
                self._read_at = self._clock()
            return list(self._entries)
