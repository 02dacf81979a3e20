"""A page pool: a free list of integer page ids with a fixed capacity."""

from __future__ import annotations

from array import array
from collections.abc import Iterable


class PagePool:
    __slots__ = ("name", "capacity", "_free")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        # Reversed so pages are handed out in ascending order (stable, easy to read in tests). An int64 array,
        # not a list: a million-entry list would be walked by every full garbage collection.
        self._free = array("q", range(capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> array:
        """n page ids as an int64 array (slices of it are copies in C, not per-int conversions)."""
        if n > len(self._free):
            raise MemoryError(f"{self.name} pool: need {n} pages, {len(self._free)} free")
        if n <= 0:
            return array("q")
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        return pages

    def alloc_one(self) -> int:
        if not self._free:
            raise MemoryError(f"{self.name} pool: no free page")
        return self._free.pop()

    def free(self, pages: Iterable[int]) -> None:
        self._free.extend(pages)

    def free_one(self, page: int) -> None:
        self._free.append(page)

    def free_ids(self) -> list[int]:
        return self._free.tolist()
