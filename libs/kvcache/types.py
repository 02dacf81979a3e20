"""Result and event types of the KV cache: plain frozen dataclasses, named tuples and enums, no behaviour."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class Direction(enum.StrEnum):
    D2H = "d2h"
    H2D = "h2d"


class Group(enum.StrEnum):
    """A layer group; each group has its own page pool on device and on host."""

    FULL = "full"
    SWA = "swa"


@dataclass(frozen=True, slots=True)
class PageCopy:
    """One page the engine must copy between tiers (same page size, same layer group on both sides)."""

    group: str
    src: int
    dst: int
    direction: str
    # With one arena: the units the device page held when the copy was made (KVCache attaches them). The engine
    # copies from / to those units: a d2h source may be evicted and its units reused before the copy runs (the
    # copies run first, so the bytes are still there), and an h2d copy whose page no longer holds them is stale.
    units: tuple[int, ...] = ()
    # With one host arena (`KVCacheConfig.host_arena_units`): the units the host page held when the copy was made
    # (the host tier attaches them). A host page may leave its node before the copy runs (a d2h target whose
    # node was pruned, an h2d source evicted from the host after the load was planned); its units are then
    # free, and only the next backup or import (after the copies ran) hands them out again.
    host_units: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The answer of `KVCache.match`.

    `tokens` is the longest valid hit L (page aligned, < len(prompt)): full KV for [0, L), SWA KV for
    [L - window, L). `full_pages[j]` / `swa_pages[j]` are the device pages of logical page j < L / page_size
    (`swa_pages[j] == -1`: no SWA KV). The hit's nodes stay locked until `admit` takes them over or
    `release_hit` is called; `load_copies` must run before the pages are read.

    A **rebuild hit** (`full_tokens` = E > `tokens` = R, only with `rebuild_tokens` > 0) has full KV for
    [0, E) but no SWA checkpoint near E: the engine recomputes [R, E) from the cached full KV, so the window
    before E comes out exact. `full_pages` covers [0, E), `swa_pages` is -1 throughout.
    """

    tokens: int
    raw_tokens: int
    host_tokens: int
    full_pages: tuple[int, ...] = ()
    swa_pages: tuple[int, ...] = ()
    load_copies: tuple[PageCopy, ...] = ()
    hit_id: int = 0
    full_tokens: int = -1
    """E: full KV is valid for [0, E). Equal to `tokens` for a normal hit (the default -1 means that)."""
    l3_tokens: int = 0
    """Of `host_tokens`, the tokens whose host copies were imported from GCache (L3) and are loaded for the
    first time by this match (the per-tier hit accounting)."""

    def __post_init__(self) -> None:
        if self.full_tokens < 0:
            object.__setattr__(self, "full_tokens", self.tokens)

    @property
    def is_rebuild(self) -> bool:
        return self.full_tokens > self.tokens


@dataclass(frozen=True, slots=True)
class HostImport:
    """Host pages `KVCache.import_blocks` gave the blocks of [start, end) (host-only tree nodes): `full` one per
    page, `swa` one per page of the checkpoint window [end - len(swa), end). The caller writes the imported
    bytes into them before the next cache call."""

    start: int
    end: int
    full: tuple[int, ...]
    swa: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RebuildStats:
    """SWA window rebuilds: hits `match` returned, of which admitted, and the tokens those admissions recompute
    (E - R each: prefill work a checkpoint at E would have saved)."""

    matched: int = 0
    admitted: int = 0
    rebuilt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class AdmitResult:
    ok: bool
    reason: str = ""
    full_pages_needed: int = 0
    swa_pages_needed: int = 0


class EventKind(enum.StrEnum):
    STORED = "stored"  # blocks became available in `tier` (also re-sent when a tombstone is healed)
    REMOVED = "removed"  # blocks left `tier`
    SWA_REMOVED = "swa_removed"  # blocks stay in `tier` but their SWA KV was dropped (no checkpoint any more)


class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"


class KVEvent(NamedTuple):
    """A numbered change of the cached block set, for the router / GCache.

    Event ids increase by one; a gap means events were dropped (the consumer should ask for a full resend).
    `swa_checkpoint[i]` says whether a hit ending after block i was valid when the event was made.
    A named tuple: every inserted or evicted node makes one, so it is built on a hot path.
    """

    event_id: int
    kind: EventKind
    tier: Tier
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    swa_checkpoint: tuple[bool, ...] = ()
    swa_held: tuple[bool, ...] = ()
    """STORED: per block, whether `tier` holds its SWA KV (all False for REMOVED / SWA_REMOVED). Unlike
    `swa_checkpoint` it never goes stale when an ancestor's SWA KV is evicted or healed later, so a router
    recomputes validity from it exactly."""


class BlockHeld(enum.IntFlag):
    """What a cache holds of one block, as `KVCache.snapshot` reports it (4 bits; `libs.routing.BlockState` is
    the same bits, pinned by tests/test_kv_events.py: the index loads snapshot states unchanged)."""

    DEVICE = 1  # full KV on device
    DEVICE_SWA = 2  # SWA KV on device
    HOST = 4  # full KV in the host tier
    HOST_SWA = 8  # SWA KV in the host tier


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """The cache's whole cached block set, consistent with its events up to `last_event_id` (-1: none issued):
    block i is `block_hashes[i]` holding `BlockHeld(states[i])` (one byte per block). Events after it follow."""

    last_event_id: int
    block_hashes: tuple[int, ...] = ()
    states: bytes = b""


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One pool: free + cached + in_use == capacity. `reserved` is the part of free + cached promised to
    running sequences for their future growth (admission does not hand it out twice)."""

    capacity: int
    free: int
    cached: int
    in_use: int
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class ArenaStats:
    """One arena (device: `KVCacheConfig.arena_units`; host: `host_arena_units`), in units: free + full and SWA
    in use / cached == units. `reserved` is the part of free + cached promised to running sequences."""

    units: int
    free: int
    full_in_use: int
    full_cached: int
    swa_in_use: int
    swa_cached: int
    reserved: int = 0


@dataclass(frozen=True, slots=True)
class PoolUsage:
    full: PoolStats
    swa: PoolStats
    host_full: PoolStats
    host_swa: PoolStats
    arena: ArenaStats | None = None
    """Set with an arena; `full` / `swa` then count pages of each group (free: what the free units would hold)."""
    host_arena: ArenaStats | None = None
    """Set with one host arena (L2); `host_full` / `host_swa` then count pages likewise. Host copies are all
    cache (evictable): `*_in_use` stay 0."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Why hits were lost (`KVCache.cache_stats`). Evictions by reason, each (victims, device units or pages
    freed): "full" (a device leaf and its SWA, LRU), "swa" (a checkpoint dropped, the node's full KV stays:
    a tombstone), "swa_leaf" (a checkpoint dropped and its leaf's full KV pruned with it), "lazy" (a running
    sequence's lazily kept checkpoint page taken back). Units with an arena, pages (full + SWA) without.
    Hit tokens of admitted requests: `raw_hit_tokens` the full-KV match (capped below the prompt's last token),
    `valid_hit_tokens` what the hit skipped; the difference is lost to missing SWA KV."""

    evictions: dict[str, tuple[int, int]]
    raw_hit_tokens: int
    valid_hit_tokens: int

    @property
    def swa_lost_tokens(self) -> int:
        return self.raw_hit_tokens - self.valid_hit_tokens
