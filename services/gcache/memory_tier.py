"""A storage node's memory tier: committed values in RAM, LRU-ordered, plus the reservations of in-flight puts."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class MemValue:
    data: bytearray | memoryview  # the put slot's own buffer (no copy at commit) or the bytes read back from disk
    checksum: int


class MemoryTier:
    """`used` (committed bytes) + `reserved` (in-flight puts) never exceeds `capacity`. The OrderedDict's first
    entry is the least recently used. Not thread-safe: one owner."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.reserved = 0
        self._values: OrderedDict[str, MemValue] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def free(self) -> int:
        return self.capacity - self.used - self.reserved

    def fits_after_demoting(self, size: int) -> bool:
        """Whether `size` bytes fit once every committed value has left (reservations cannot be demoted)."""
        return size <= self.capacity - self.reserved

    def reserve(self, size: int) -> None:
        assert size <= self.free(), "reserve without room"
        self.reserved += size

    def release(self, size: int) -> None:
        self.reserved -= size

    def insert(self, key: str, value: MemValue) -> None:
        assert len(value.data) <= self.free(), "insert without room"
        self._values[key] = value
        self.used += len(value.data)

    def get(self, key: str) -> MemValue | None:
        """The value, now the most recently used."""
        v = self._values.get(key)
        if v is not None:
            self._values.move_to_end(key)
        return v

    def peek(self, key: str) -> MemValue | None:
        """The value, its LRU place unchanged."""
        return self._values.get(key)

    def pop(self, key: str) -> MemValue | None:
        v = self._values.pop(key, None)
        if v is not None:
            self.used -= len(v.data)
        return v

    def pop_lru(self) -> tuple[str, MemValue]:
        key = next(iter(self._values))
        v = self.pop(key)
        assert v is not None
        return key, v

    def keys_lru(self) -> list[str]:
        """Keys, least recently used first (tests, invariants)."""
        return list(self._values)

    def clear(self) -> None:
        self._values.clear()
        self.used = 0

    def check_invariants(self, reserved: int) -> None:
        """`reserved`: what the in-flight puts say they hold."""
        assert self.used == sum(len(v.data) for v in self._values.values()), "memory used != sum of values"
        assert self.reserved == reserved, f"reservations {self.reserved} != in-flight sizes {reserved}"
        assert 0 <= self.used + self.reserved <= self.capacity, "memory budget exceeded"
