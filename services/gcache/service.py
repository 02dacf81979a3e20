"""Wiring of a GCache storage node (role cache): a `NodeStore`, a transfer engine, the three cache subjects.

Serves `windserve.<ns>.cache.<id>.{exists,get,put}` (`handlers.CacheNode`). Its registry entry carries the
transfer address (clients send and receive values there), the total byte budget as capacity, and the
store's usage, refreshed every heartbeat. Background: `reap` of unfinished puts every `reap_interval_s`.
Shutdown: stop serving, drain handlers, then close the engine (transfers in flight fail: their puts abort)
and the store.
"""

from __future__ import annotations

import asyncio
import contextlib

from libs.gcache.arena import Allocator, SegmentArena
from libs.service import Service
from libs.transfer import KVTransferEngine, TransferBackend, advertised_address, create_engine
from protos import subjects
from protos.messages import CacheExistsRequest, CacheGetRequest, CachePutRequest, RegistryEntry, Role
from services.gcache.config import CacheConfig
from services.gcache.direct import DirectNode
from services.gcache.handlers import CacheNode
from services.gcache.store import NodeStore

_PREFAULT_WAIT_S = 120.0
_SEGMENT_BYTES = 64 << 20  # arena segment: a 64 MiB value fills one; smaller values share one


def _arena(cfg: CacheConfig) -> SegmentArena | None:
    """The memory tier's arena (memory_arena): memory_bytes in segments of 64 MiB (a quarter of a smaller
    budget); values larger than a segment get their own buffers."""
    if not cfg.memory_arena or cfg.memory_bytes < 4:
        return None
    return SegmentArena(cfg.memory_bytes, min(_SEGMENT_BYTES, cfg.memory_bytes // 4))


class CacheService(Service):
    role = Role.CACHE
    config: CacheConfig

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        # UCX or the TCP fallback (a bad WINDSERVE_TRANSFER fails here, before any IO)
        self.transfer: KVTransferEngine = create_engine()
        self.arena = _arena(config)
        self.store = NodeStore(config.memory_bytes, config.disk_bytes, config.disk_path or None,
                               put_timeout_s=config.put_timeout_s, allocate=Allocator(None), arena=self.arena)
        self.node: CacheNode | None = None
        self.direct: DirectNode | None = None

    async def setup(self) -> None:
        assert self.bus is not None
        cfg = self.config
        if self.arena is not None and cfg.prefault:  # (before the node announces itself: its puts never fault)
            done = asyncio.Event()
            loop = asyncio.get_running_loop()
            self.arena.prefault(lambda: loop.call_soon_threadsafe(done.set))
            with contextlib.suppress(TimeoutError):  # past the bound it goes on in the background (writes nothing)
                async with asyncio.timeout(_PREFAULT_WAIT_S):
                    await done.wait()
        bound = await self.transfer.start(host=cfg.transfer_host, port=cfg.transfer_port)
        self.node = CacheNode(cfg, self.store, self.transfer, advertised_address(bound, cfg.advertise_host),
                              lambda coro, name: self.spawn(coro, name=name))
        if self.transfer.backend is TransferBackend.UCX:  # the direct path (clients' puts and gets without NATS)
            self.direct = DirectNode(self.node, self.transfer, lambda coro, name: self.spawn(coro, name=name))
        ns, iid = cfg.namespace, cfg.instance_id
        await self.bus.serve(subjects.cache_exists(ns, iid), CacheExistsRequest, self.node.exists)
        await self.bus.serve(subjects.cache_put(ns, iid), CachePutRequest, self.node.put)
        await self.bus.serve(subjects.cache_get(ns, iid), CacheGetRequest, self.node.get)
        self.spawn(self._upkeep_loop(), name="cache-upkeep")

    async def teardown(self) -> None:
        try:
            await self.transfer.close()
        finally:
            self.store.close()

    def registry_entry(self) -> RegistryEntry:
        return super().registry_entry().model_copy(update={
            "address": self.node.address if self.node is not None else "",
            "capacity": self.config.capacity_bytes,
            "cache": self.store.usage(),
        })

    def health_details(self) -> dict[str, str]:
        details = self.node.details() if self.node is not None else {}
        if self.direct is not None:
            details.update(direct_puts=str(self.direct.puts), direct_gets=str(self.direct.gets))
        if self.arena is not None:
            a = self.arena
            details.update(arena_bytes=str(a.capacity), arena_free_segments=str(a.free_segments()),
                           arena_fallbacks=str(a.fallbacks), arena_prefaulted=str(a.prefaulted))
        return details

    async def _upkeep_loop(self) -> None:
        """Reap unfinished puts; refresh the usage the next heartbeat publishes, and the metrics."""
        assert self.node is not None
        cfg = self.config
        interval = min(cfg.reap_interval_s, cfg.heartbeat_interval_s)
        while True:
            await asyncio.sleep(interval)
            self.node.reap()
            self.node.export_metrics()
            self.refresh_registration()
