"""`BlockStore`: the interface the engine side (prefetch into L2, write-back) types a GCache client against.

Contract: every call is bounded by the store's own timeouts and never raises for a node that is dead, slow or
unreachable — its keys are misses (`exists` False, `get` None) and a write-back to it is dropped. `put_nowait`
never blocks (a full write-back queue drops the batch and says so) and may be called from any thread.

The real client is `libs.gcache.client.GCacheClient(nats_url, namespace, config=GCacheConfig())`: `await
start()` (its IO thread, NATS connection, transfer engine and registry watch; bounded wait for the first
membership), the `BlockStore` methods callable from any event loop, `await close()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

Buffer = bytes | bytearray | memoryview


class BlockStore(Protocol):
    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key: stored, committed and (as far as the node knows) readable."""
        ...

    async def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """One value per key (None: a miss — absent, corrupt, or its node failed or timed out)."""
        ...

    async def put(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Write a batch and wait (bounded) for it: per item, True if this call stored it (False: already
        stored, refused for room, or its node failed)."""
        ...

    def put_nowait(self, items: Sequence[tuple[str, Buffer]]) -> bool:
        """Queue a batch of (key, value) for writing; False if the write-back queue is full (batch dropped).
        Keys are immutable: a key already stored keeps its value."""
        ...
