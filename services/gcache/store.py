"""A storage node's tiers: what it holds, where, and when a value becomes visible (pure: no NATS, no UCX).

`NodeStore` composes a `MemoryTier` and an optional `DiskTier`. Promises: a put (`begin_put` → `PutSlot`)
is invisible until `commit` verified its checksum, and committed values are immutable; abort, a bad
checksum or `reap` past `put_timeout_s` return the reservation. Tiers are exclusive and LRU (memory demotes
to disk, disk evicts). Every read verifies the checksum (xxh3-64): wrong bytes are never returned, a
mismatch drops the value and is a miss (`lookup` leaves a memory value's hash to the caller). Calls are
O(1) in the number of keys. One owner, not thread-safe. Details: docs/gcache.md, "Storage tiers".
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from libs.gcache.arena import SegmentArena
from libs.gcache.keys import value_checksum
from protos.messages import CacheUsage

from .disk_tier import MAX_KEY_BYTES, DiskTier
from .memory_tier import MemoryTier, MemValue


class PutState(enum.Enum):
    WRITING = "writing"
    COMMITTED = "committed"
    DROPPED = "dropped"  # commit found a checksum mismatch
    ABORTED = "aborted"
    REAPED = "reaped"


@dataclass
class PutSlot:
    """A value being written: its bytes land in `buffer` (exactly `size` bytes); invisible until committed.
    After `commit` the buffer belongs to the store (no copy is made): the writer must not touch it again."""

    key: str
    size: int
    checksum: int
    buffer: bytearray | memoryview  # writable, exactly `size` bytes (the store's `allocate`)
    started_at: float = field(default=0.0)
    state: PutState = PutState.WRITING


@dataclass(frozen=True, slots=True)
class Found:
    """A value `lookup` found: its bytes (read-only) and checksum. `verified` False (a memory value): the bytes
    were not hashed yet, and the caller must check them against `checksum` before any of them counts as read,
    reporting a mismatch with `failed_verification`."""

    data: memoryview
    checksum: int
    verified: bool
    source: MemValue | None = None  # the memory tier's entry (what a failed verification drops)


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    checksum_failures: int = 0  # values dropped at commit or read: content checksum, or a disk file's header
    demotions: int = 0
    promotions: int = 0
    evictions: int = 0  # committed values dropped for room (either tier, including on re-index)
    reaped: int = 0
    rejected: int = 0  # begin_put refused: key committed or in flight, no room, or invalid
    committed: int = 0
    aborted: int = 0
    removed_files: int = 0  # temporary / truncated / corrupt files deleted by the re-index at start
    fresh_buffers: int = 0  # put slots of a size the arena holds outside it (no room even after its evictions)


class NodeStore:
    """Keys are immutable; a value is visible only after `commit` verified its checksum.

    `disk_dir` and `disk_bytes > 0` enable the disk tier; an existing directory is indexed again (its valid
    values are served, its broken files deleted, its budget enforced). Without a disk tier the directory is
    never touched.
    """

    def __init__(self, memory_bytes: int, disk_bytes: int = 0, disk_dir: str | Path | None = None,
                 put_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 allocate: Callable[[int], bytearray | memoryview] = bytearray, arena: SegmentArena | None = None,
                 arena_evict_segments: int = 2) -> None:
        self.memory_bytes, self.disk_bytes = memory_bytes, disk_bytes
        self.put_timeout_s, self._clock = put_timeout_s, clock
        # A put slot's buffer: writable, uninitialised is fine (every byte is received, and the checksum at
        # commit catches any that was not). From `arena` (the node's: reused, pre-faulted memory) when it has
        # room (`_buffer`), else `allocate`.
        self._allocate = allocate
        self._arena = arena
        self._arena_evict_bytes = arena_evict_segments * arena.segment_bytes if arena is not None else 0
        self._memory = MemoryTier(memory_bytes)
        self._disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None and disk_bytes > 0 else None
        self._inflight: dict[str, PutSlot] = {}
        self._stats = StoreStats()
        if self._disk is not None:
            r = self._disk.reindex()
            self._stats.evictions += r.evicted
            self._stats.removed_files += r.removed

    # -- puts --------------------------------------------------------------------------------------------------

    def begin_put(self, key: str, size: int, checksum: int) -> PutSlot | None:
        """A slot to write the value into, or None: already stored, being stored, invalid, or no room (a value
        larger than the memory budget left after in-flight reservations is refused)."""
        if (key in self._inflight or self.exists(key) or not _valid_key(key) or size < 0
                or not self._memory.fits_after_demoting(size)):
            self._stats.rejected += 1
            return None
        self._make_memory_room(size)
        self._memory.reserve(size)
        slot = PutSlot(key, size, checksum, self._buffer(size), self._clock())
        self._inflight[key] = slot
        return slot

    def commit(self, slot: PutSlot, digest: int | None = None) -> bool:
        """Make the slot's value visible if its bytes match its checksum; otherwise drop it. False: dropped (or
        the slot was no longer in flight: aborted, reaped, committed already). `digest`: the value's checksum
        (`value_checksum`) the caller vouches for (the direct path passes the writer's sum: its bytes are first
        verified by the first read); None: hashed here."""
        if not self._end_put(slot):
            return False
        if digest is None and len(slot.buffer) == slot.size:
            digest = value_checksum(slot.buffer)
        if len(slot.buffer) != slot.size or digest != slot.checksum:
            slot.state = PutState.DROPPED
            self._stats.checksum_failures += 1
            return False
        # the reservation just returned is exactly the room this insert needs
        self._memory.insert(slot.key, MemValue(slot.buffer, slot.checksum))
        slot.state = PutState.COMMITTED
        self._stats.committed += 1
        return True

    def abort(self, slot: PutSlot) -> None:
        if self._end_put(slot):
            slot.state = PutState.ABORTED
            self._stats.aborted += 1

    def reap(self) -> int:
        """Drop in-flight puts older than put_timeout_s (a client that died mid-put); how many."""
        now = self._clock()
        old = [s for s in self._inflight.values() if now - s.started_at > self.put_timeout_s]
        for s in old:
            self._end_put(s)
            s.state = PutState.REAPED
        self._stats.reaped += len(old)
        return len(old)

    def _end_put(self, slot: PutSlot) -> bool:
        """Take a slot out of flight and return its reservation; False if it was not (still) in flight."""
        if slot.state is not PutState.WRITING or self._inflight.get(slot.key) is not slot:
            return False
        del self._inflight[slot.key]
        self._memory.release(slot.size)
        return True

    # -- reads -------------------------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Committed (in either tier); not verified (a bad value is found, and dropped, by `get`)."""
        return key in self._memory or (self._disk is not None and key in self._disk)

    def get(self, key: str) -> memoryview | None:
        """The value's bytes (read-only), verified against its checksum (a bad value is dropped and is a miss)."""
        data = self._get_memory(key)
        if data is None and self._disk is not None and key in self._disk:
            data = self._get_disk(self._disk, key)
        if data is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        return memoryview(data).toreadonly()

    def lookup(self, key: str) -> Found | None:
        """`get` with the memory tier's verification left to the caller, so that it can overlap the hash with
        sending the bytes (the node's get handlers: the NATS path's transfer cannot complete, and the direct
        path's client returns nothing, before the hash matched). A
        disk value is read and verified here, as by `get`. Counts a hit; `failed_verification` turns it into
        a miss."""
        v = self._memory.get(key)
        if v is not None:
            self._stats.hits += 1
            return Found(memoryview(v.data).toreadonly(), v.checksum, False, v)
        entry = self._disk.entry(key) if self._disk is not None else None
        data = self._get_disk(self._disk, key) if self._disk is not None and entry is not None else None
        if data is None or entry is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        return Found(memoryview(data).toreadonly(), entry.checksum, True)

    def failed_verification(self, key: str, found: Found) -> None:
        """The caller's hash of an unverified `lookup` did not match: the value is dropped (if still stored)
        and the hit counted as a miss and a checksum failure."""
        self._stats.hits -= 1
        self._stats.misses += 1
        self._stats.checksum_failures += 1
        if found.source is not None and self._memory.peek(key) is found.source:
            self._memory.pop(key)

    def _get_memory(self, key: str) -> bytearray | memoryview | None:
        v = self._memory.get(key)
        if v is None:
            return None
        if value_checksum(v.data) != v.checksum:
            self._memory.pop(key)
            self._stats.checksum_failures += 1
            return None
        return v.data

    def _get_disk(self, disk: DiskTier, key: str) -> bytearray | None:
        entry = disk.entry(key)
        assert entry is not None
        data = disk.read(key)
        if data is None or value_checksum(data) != entry.checksum:
            disk.remove(key)
            self._stats.checksum_failures += 1
            return None
        if self._memory.fits_after_demoting(len(data)):
            disk.remove(key)  # first: the demotions below may need its disk room
            self._make_memory_room(len(data))
            self._memory.insert(key, MemValue(data, entry.checksum))
            self._stats.promotions += 1
        else:
            disk.touch(key)
        return data

    # -- room --------------------------------------------------------------------------------------------------

    def _make_memory_room(self, size: int) -> None:
        """Demote (or evict) least recently used memory values until `size` bytes are free; the caller checked
        `fits_after_demoting(size)`."""
        while self._memory.free() < size:
            self._demote(*self._memory.pop_lru())

    def _buffer(self, size: int) -> bytearray | memoryview:
        """A put slot's buffer: from the arena when it has room. When it has none though the budget has (its free
        bytes scattered over segments that still hold other values), the least recently used values are demoted
        or evicted, at most `arena_evict_segments` segments' worth, until it has: they would be the next to go,
        and a fresh buffer would fault its pages in as the bytes land and hold memory beside the arena's. Past
        that (a segment pinned by a send in flight), a fresh buffer (`allocate`), as for a value the arena never
        holds (0 bytes, or larger than a segment)."""
        arena = self._arena
        if arena is None or not 0 < size <= arena.segment_bytes:
            return self._allocate(size)
        left = self._arena_evict_bytes
        while (buf := arena.alloc(size)) is None and left > 0 and len(self._memory):
            key, v = self._memory.pop_lru()
            left -= len(v.data)
            self._demote(key, v)
            del v  # (the last reference: its segment is free once no reader holds it)
        if buf is not None:
            return buf
        self._stats.fresh_buffers += 1
        return self._allocate(size)

    def _demote(self, key: str, v: MemValue) -> None:
        disk = self._disk
        if disk is not None and len(v.data) <= disk.capacity:
            self._stats.evictions += disk.make_room(len(v.data))
            # the value's checksum travels with it: memory corruption before the demotion is caught on read
            if disk.write(key, v.data, v.checksum):
                self._stats.demotions += 1
                return
        self._stats.evictions += 1

    # -- reporting ---------------------------------------------------------------------------------------------

    def usage(self) -> CacheUsage:
        disk = self._disk
        return CacheUsage(memory_used=self._memory.used, memory_capacity=self.memory_bytes,
                          disk_used=disk.used if disk else 0, disk_capacity=disk.capacity if disk else 0,
                          keys=len(self._memory) + (len(disk) if disk else 0))

    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, checksum_failures, demotions, promotions, evictions, reaped, rejected,
        committed, aborted, removed_files, fresh_buffers."""
        return asdict(self._stats)

    def inflight(self) -> int:
        """Puts in flight (begun, not yet committed, aborted or reaped)."""
        return len(self._inflight)

    def check_invariants(self) -> None:
        """Budgets hold, reservations equal the in-flight sizes, and each key is in at most one place."""
        self._memory.check_invariants(sum(s.size for s in self._inflight.values()))
        mem, flying = set(self._memory.keys_lru()), set(self._inflight)
        assert not mem & flying, "a key both committed and in flight"
        assert all(s.state is PutState.WRITING for s in self._inflight.values())
        if self._disk is not None:
            self._disk.check_invariants()
            disk = set(self._disk.keys_lru())
            assert not disk & mem and not disk & flying, "a key in two places"

    def close(self) -> None:
        """Forget in-flight puts and the memory tier (the disk tier's files stay for the next start)."""
        for s in list(self._inflight.values()):
            self.abort(s)
        self._memory.clear()


def _valid_key(key: str) -> bool:
    return 0 < len(key) and len(key.encode()) <= MAX_KEY_BYTES
