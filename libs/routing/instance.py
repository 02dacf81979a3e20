"""What routing knows of one live instance: a small pure view, built from its registry entry at the
service boundary (`instance_of`), so the choice logic never touches wire models or IO."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol


@dataclass(frozen=True)
class Instance:
    """One live worker as the router sees it. An instance that reported no load counts as idle
    (`updated_at` None): a worker that has just registered gets traffic at once."""

    instance_id: str
    address: str = ""
    """KV transfer address; a decode worker without one cannot receive KV and is never chosen."""
    buckets: tuple[int, ...] = ()
    """Length buckets the instance is meant for; () = all."""
    max_tokens: int = 0
    """Most tokens (prompt + output) one request may hold there; 0 = unknown."""
    running: int = 0
    waiting: int = 0
    kv_full_used: int = 0
    kv_full_total: int = 0
    kv_units_used: int = 0
    kv_units_total: int = 0
    """One KV arena's units in use (or promised) and in all; 0 = the static pools."""
    prefill_tokens_queued: int = 0
    """Prefill tokens queued or running there (uncached), 0 = unknown; the KV-affinity cost's queue term."""
    updated_at: float | None = None
    """Unix time of the load snapshot the numbers above come from; None = no load reported."""
    arrivals: int | None = None
    """Requests the instance had taken on since it started, as of that snapshot; None = not reported."""

    @property
    def queue(self) -> int:
        """Requests holding KV there plus those queued for admission."""
        return self.running + self.waiting

    @property
    def kv_share(self) -> float:
        """Share of the KV memory in use: the arena's units where the instance has one, else the full-attention
        pool's pages (0.0 when the total is unknown)."""
        if self.kv_units_total:
            return self.kv_units_used / self.kv_units_total
        return self.kv_full_used / max(1, self.kv_full_total)


class LoadLike(Protocol):
    """The load fields routing reads (`protos.messages.WorkerLoad` has them)."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def kv_full_used(self) -> int: ...
    @property
    def kv_full_total(self) -> int: ...
    @property
    def kv_units_used(self) -> int: ...
    @property
    def kv_units_total(self) -> int: ...
    @property
    def updated_at(self) -> float: ...
    @property
    def arrivals(self) -> int: ...


class EntryLike(Protocol):
    """The registry-entry fields routing reads (`protos.messages.RegistryEntry` has them). A protocol
    rather than the wire type keeps this package free of protos and pydantic."""

    @property
    def instance_id(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def buckets(self) -> Sequence[int]: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def load(self) -> LoadLike | None: ...


def instance_of(entry: EntryLike) -> Instance:
    """The routing view of a registry entry."""
    base = Instance(entry.instance_id, address=entry.address, buckets=tuple(entry.buckets),
                    max_tokens=entry.max_tokens)
    load = entry.load
    if load is None:
        return base
    return replace(base, running=load.running, waiting=load.waiting, kv_full_used=load.kv_full_used,
                   kv_full_total=load.kv_full_total, kv_units_used=load.kv_units_used,
                   kv_units_total=load.kv_units_total, updated_at=load.updated_at,
                   arrivals=load.arrivals if load.arrivals >= 0 else None)
