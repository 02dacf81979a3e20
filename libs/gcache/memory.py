"""An in-process `BlockStore` (a dict): for unit tests of the engine side's pure logic only; the real store is
`GCacheClient` over storage-node processes."""

from __future__ import annotations

from collections.abc import Sequence

from .api import Buffer


class MemoryBlockStore:
    def __init__(self, max_queue: int = 64) -> None:
        self.values: dict[str, bytes] = {}
        self.max_queue = max_queue
        self.dropped = 0
        self.gets = 0

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.values for k in keys]

    async def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        self.gets += 1
        return [self.values.get(k) for k in keys]

    async def put(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        out = [k not in self.values for k, _ in items]
        self.put_nowait(items)
        return out

    def put_nowait(self, items: Sequence[tuple[str, Buffer]]) -> bool:
        for k, v in items:
            self.values.setdefault(k, bytes(v))
        return True
