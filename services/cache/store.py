"""A storage node's tiers: what it holds, where, and when a value becomes visible (pure: no NATS, no UCX).

INTERFACE STUB (lead, wave 4): a memory-only dict with the final method signatures, so the node service and
the SDK can be built against it; the real tiers (memory + disk budgets, LRU demotion / promotion, checksum on
every read, atomic puts, partial-put reaping, disk re-index on restart) replace it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from libs.gcache.keys import value_checksum
from protos.messages import CacheUsage


@dataclass
class PutSlot:
    """A value being written: its bytes land in `buffer` (exactly `size` bytes); invisible until committed."""

    key: str
    size: int
    checksum: int
    buffer: bytearray
    started_at: float = field(default=0.0)


class NodeStore:
    """Keys are immutable; a value is visible only after `commit` verified its checksum."""

    def __init__(self, memory_bytes: int, disk_bytes: int = 0, disk_dir: str | Path | None = None,
                 put_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.memory_bytes, self.disk_bytes, self.put_timeout_s, self._clock = memory_bytes, disk_bytes, put_timeout_s, clock
        self._values: dict[str, bytes] = {}
        self._inflight: dict[str, PutSlot] = {}

    def begin_put(self, key: str, size: int, checksum: int) -> PutSlot | None:
        """A slot to write the value into, or None: already stored, being stored, or no room."""
        if key in self._values or key in self._inflight or size > self.memory_bytes:
            return None
        slot = PutSlot(key, size, checksum, bytearray(size), self._clock())
        self._inflight[key] = slot
        return slot

    def commit(self, slot: PutSlot) -> bool:
        """Make the slot's value visible if its bytes match its checksum; otherwise drop it. False: dropped."""
        if self._inflight.pop(slot.key, None) is not slot:
            return False
        if value_checksum(slot.buffer) != slot.checksum:
            return False
        self._values[slot.key] = bytes(slot.buffer)
        return True

    def abort(self, slot: PutSlot) -> None:
        if self._inflight.get(slot.key) is slot:
            del self._inflight[slot.key]

    def reap(self) -> int:
        """Drop in-flight puts older than put_timeout_s (a client that died mid-put); how many."""
        old = [s for s in self._inflight.values() if self._clock() - s.started_at > self.put_timeout_s]
        for s in old:
            self.abort(s)
        return len(old)

    def exists(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str) -> memoryview | None:
        """The value's bytes, verified against its checksum (a bad value is dropped and is a miss)."""
        v = self._values.get(key)
        return None if v is None else memoryview(v)

    def usage(self) -> CacheUsage:
        used = sum(len(v) for v in self._values.values())
        return CacheUsage(memory_used=used, memory_capacity=self.memory_bytes, disk_used=0,
                          disk_capacity=self.disk_bytes, keys=len(self._values))

    def stats(self) -> dict[str, int]:
        """Counters: hits, misses, checksum_failures, demotions, promotions, evictions, reaped, rejected."""
        return {}

    def close(self) -> None:
        pass
