"""The storage node's request handlers: exists, put (announce → transfer → commit), get (sizes → transfer).

`CacheNode` drives the `NodeStore` for the NATS path: control messages over NATS, value bytes as one
transfer per request (`libs.gcache.wire`). A put's slots are committed (checksums verified by the store)
when its transfer completes, and aborted when it fails or outlives `put_timeout_s`: nothing is visible
before its commit, and `reap` is the backstop. A get sends the found values as the transfer the client
expects, bounded by `send_timeout_s`; memory values are verified while in flight and disk values when read,
so a bad value never reaches the client as a hit. Protocol: docs/gcache.md, "The NATS path".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import torch

from libs.gcache import wire
from libs.gcache.keys import value_checksum
from libs.transfer import IncomingTransfer, KVTransferEngine, TransferError, TransferHeader
from libs.transfer.transfers import DestinationFactory
from protos.messages import (
    CacheExistsReply,
    CacheExistsRequest,
    CacheGetReply,
    CacheGetRequest,
    CachePutReply,
    CachePutRequest,
)
from services.gcache import metrics
from services.gcache.config import CacheConfig
from services.gcache.store import Found, NodeStore, PutSlot

log = logging.getLogger("windserve.cache")
K = TypeVar("K")

Spawn = Callable[[Coroutine[Any, Any, Any], str], object]


class CacheNode:
    """One node's handlers over its store and transfer engine; `spawn` runs the transfers in the background
    (the service's task set, so shutdown cancels them)."""

    def __init__(self, config: CacheConfig, store: NodeStore, engine: KVTransferEngine, address: str,
                 spawn: Spawn) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.address = address
        self._spawn = spawn
        self.inflight_gets = 0
        """Gets whose values are being sent (in-flight puts are the store's `inflight()`)."""

    # ------------------------------------------------------------------ exists

    async def exists(self, req: CacheExistsRequest) -> CacheExistsReply:
        return CacheExistsReply(present=[self.store.exists(k) for k in req.keys])

    # ------------------------------------------------------------------ put

    async def put(self, req: CachePutRequest) -> CachePutReply:
        slots = [self.store.begin_put(it.key, it.size, it.checksum) for it in req.items]
        taken = [s for s in slots if s is not None]
        metrics.PUTS.labels("accepted").inc(len(taken))
        metrics.PUTS.labels("refused").inc(len(slots) - len(taken))
        if any(s.size for s in taken):
            positions = [i for i, s in enumerate(slots) if s is not None]
            try:
                incoming = self.engine.expect(req.transfer_id, _destinations(taken, req.chunk_bytes, positions))
            except (ValueError, RuntimeError):  # a duplicate transfer id: refuse the whole batch
                self._abort(taken, "the transfer could not be expected")
                raise
            self._spawn(self._receive(incoming, taken), f"put-{req.transfer_id}")
        else:
            for slot in taken:  # 0-byte values: no transfer
                self._commit(slot)
        return CachePutReply(accepted=[s is not None for s in slots], address=self.address)

    async def _receive(self, incoming: IncomingTransfer, slots: list[PutSlot]) -> None:
        try:
            await incoming.wait(timeout=self.config.put_timeout_s)
        except TransferError as exc:
            self._abort(slots, str(exc))
            return
        except BaseException:
            self._abort(slots, "node shutting down")
            raise
        metrics.BYTES.labels("in").inc(sum(s.size for s in slots))
        for slot in slots:
            self._commit(slot)

    def _commit(self, slot: PutSlot) -> None:
        ok = self.store.commit(slot)
        metrics.PUTS.labels("committed" if ok else "dropped").inc()
        if not ok:
            log.warning("put dropped at commit (checksum mismatch or reaped)", extra={"key": slot.key})

    def _abort(self, slots: list[PutSlot], why: str) -> None:
        for slot in slots:
            self.store.abort(slot)
        metrics.PUTS.labels("aborted").inc(len(slots))
        log.info("put aborted", extra={"values": len(slots), "error": why})

    # ------------------------------------------------------------------ get

    def lookup_all(self, keys: list[str]) -> list[Found | None]:
        """The store's values of `keys` (a memory value unverified: the caller hashes it while sending; a 0-byte
        one is verified here, having no bytes to hold back), hits and misses counted."""
        values = [self.store.lookup(k) for k in keys]
        for i, v in enumerate(values):
            if v is not None and not v.verified and not len(v.data) and value_checksum(v.data) != v.checksum:
                self.store.failed_verification(keys[i], v)
                values[i] = None
        hits = sum(v is not None for v in values)
        metrics.LOOKUPS.labels("hit").inc(hits)
        metrics.LOOKUPS.labels("miss").inc(len(values) - hits)
        return values

    async def get(self, req: CacheGetRequest) -> CacheGetReply:
        values = self.lookup_all(req.keys)
        sizes = [-1 if v is None else len(v.data) for v in values]
        found = [(i, v) for i, v in enumerate(values) if v is not None and len(v.data)]
        if found:
            self.inflight_gets += 1
            self._spawn(self._send(req, found), f"get-{req.transfer_id}")
        return CacheGetReply(sizes=sizes)

    async def _send(self, req: CacheGetRequest, found: list[tuple[int, Found]]) -> None:
        """Send the found values; the memory tier's values are hashed (in a thread) while every layer but the
        last is in flight, and the last goes only once every value matched its checksum: otherwise the transfer
        is aborted (the client's whole batch misses) and the bad values are dropped. So the client's transfer
        never completes with a bad value, and the hash costs no time of its own."""
        specs = wire.layer_specs([len(v.data) for _, v in found], req.chunk_bytes, [i for i, _ in found])
        payloads = [view for _, v in found for view in wire.chunk_views(v.data, req.chunk_bytes)]
        unverified = [(req.keys[i], v) for i, v in found if not v.verified]
        check = asyncio.ensure_future(asyncio.to_thread(mismatches, unverified)) if unverified else None
        taken = False  # whether the verdict was acted on here
        try:
            async with asyncio.timeout(self.config.send_timeout_s):
                tx = await self.engine.begin_send(req.address, req.transfer_id, specs)
                try:
                    await tx.send_layers(payloads[:-1])
                    bad = await check if check is not None else []
                    taken = True
                    if bad:
                        for key, v in bad:
                            self.store.failed_verification(key, v)
                        metrics.SEND_FAILURES.inc()
                        log.warning("get: values failed their checksum, transfer aborted",
                                    extra={"transfer_id": req.transfer_id, "keys": [k for k, _ in bad]})
                        await tx.abort("a value failed its checksum")
                        return
                    await tx.send_layers(payloads[-1:])
                    stats = await tx.finish()
                except BaseException:
                    await tx.abort("sender failed")
                    raise
            metrics.BYTES.labels("out").inc(stats.nbytes)
        except (TransferError, TimeoutError, OSError, ValueError) as exc:  # the client left, or is too slow
            metrics.SEND_FAILURES.inc()
            log.info("get transfer failed", extra={"transfer_id": req.transfer_id, "error": repr(exc)})
        finally:
            self.inflight_gets -= 1
            if check is not None and not taken:  # the send failed first: the verdict still counts
                check.add_done_callback(self._late_verdict)

    def _late_verdict(self, fut: asyncio.Future[list[tuple[str, Found]]]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            for key, v in fut.result():
                self.store.failed_verification(key, v)

    # ------------------------------------------------------------------ upkeep

    def reap(self) -> int:
        reaped = self.store.reap()
        if reaped:  # counted by the store (`windserve_cache_store{counter="reaped"}`)
            log.info("reaped unfinished puts", extra={"count": reaped})
        return reaped

    def export_metrics(self) -> None:
        usage = self.store.usage()
        for tier, used, cap in (("memory", usage.memory_used, usage.memory_capacity),
                                ("disk", usage.disk_used, usage.disk_capacity)):
            metrics.USAGE.labels(tier, "used").set(used)
            metrics.USAGE.labels(tier, "capacity").set(cap)
        metrics.KEYS.set(usage.keys)
        for name, value in self.store.stats().items():
            metrics.STORE.labels(name).set(value)

    def details(self) -> dict[str, str]:
        usage = self.store.usage()
        return {"address": self.address, "keys": str(usage.keys), "memory_used": str(usage.memory_used),
                "disk_used": str(usage.disk_used), "inflight_puts": str(self.store.inflight()),
                "inflight_gets": str(self.inflight_gets),
                **{k: str(v) for k, v in self.store.stats().items()}}


def mismatches(values: list[tuple[K, Found]]) -> list[tuple[K, Found]]:
    """The values whose bytes do not match their checksum, each with its name (a key, a position); run it in a
    thread: xxhash releases the GIL."""
    return [(key, v) for key, v in values if value_checksum(v.data) != v.checksum]


def _destinations(slots: list[PutSlot], chunk_bytes: int, positions: list[int]) -> DestinationFactory:
    """The expected transfer's destinations: each accepted slot's buffer in chunk views, checked against the
    header (a sender announcing other sizes or positions is rejected by the engine: ValueError)."""
    views = [view for slot in slots for view in wire.chunk_views(slot.buffer, chunk_bytes)]
    want = {pos: slot.size for pos, slot in zip(positions, slots, strict=True) if slot.size}

    def allocate(header: TransferHeader) -> list[torch.Tensor]:
        if wire.value_sizes(header.layers) != want or len(header.layers) != len(views):
            raise ValueError(f"transfer {header.request_id}: layers do not match the accepted values")
        return views

    return allocate
