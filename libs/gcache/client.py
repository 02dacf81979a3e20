"""`GCacheClient`: the real `BlockStore`, over the storage nodes of the registry (docs/gcache.md).

    client = GCacheClient("nats://127.0.0.1:4222", "default", GCacheConfig())
    await client.start()                 # IO thread(s), NATS, transfer engine, registry watch
    await client.put([(key, value)])     # [True]: stored by this call
    await client.exists([key])           # [True]
    await client.get([key])              # [value]
    client.put_nowait([(key, value)])    # write-back: queued or dropped, never blocks
    await client.close()

All GCache IO runs on the client's own IO threads (`io_threads`), never on the caller's loop or an engine
thread. Failure contract: every call is bounded by `op_timeout_s`; a dead, unreachable, slow or confused
node yields misses, counted in `stats`, never an exception or a hang. The ring follows the registry, so a
node whose entry goes leaves it within the registry TTL. Replication 2: `put` writes both successors,
`get` asks the second only for what the first missed. Details: docs/gcache.md, "Contract".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch

from libs.bus import Bus, BusError, Registry, RegistryEventKind, RegistryView, ViewConfig
from libs.transfer import (
    KVTransferEngine,
    TransferBackend,
    TransferError,
    TransferHeader,
    advertised_address,
    create_engine,
)
from protos import subjects
from protos.base import ProtocolError
from protos.messages import (
    CacheExistsReply,
    CacheExistsRequest,
    CacheGetReply,
    CacheGetRequest,
    CachePutItem,
    CachePutReply,
    CachePutRequest,
    RegistryEntry,
    Role,
)

from . import wire
from .api import Buffer
from .arena import Allocator, SegmentArena
from .config import GCacheConfig
from .direct import DirectCalls, DirectUnreachable
from .keys import value_checksum
from .ring import HashRing

log = logging.getLogger("windserve.gcache")

MAX_BATCH = 4096  # keys / items per cache message (protos)
_CONNECT_TIMEOUT_S = 5.0
_CLOSE_TIMEOUT_S = 5.0
_GRACE_S = 0.5  # the hop back from the IO loop, on top of op_timeout_s
# Failures of one node's share of a call: it becomes misses (TimeoutError: the op bound ran out).
_NODE_FAILURES = (BusError, TransferError, ProtocolError, TimeoutError, OSError, ValueError)

T = TypeVar("T")


@dataclass
class GCacheStats:
    """Counters since start (read with `GCacheClient.stats()`)."""

    hits: int = 0
    """Keys a get returned a value for."""
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    stored: int = 0
    """Put items stored by this client (on at least one node)."""
    refused: int = 0
    """Put items no node took (already stored, no room, or every replica failed)."""
    dropped: int = 0
    """Write-back batches dropped: the queue was full (or the client not running)."""
    errors: int = 0
    """Node requests or transfers that failed or timed out (each gave misses)."""
    corrupt: int = 0
    """Values a get received that their node found corrupt while sending them (misses; dropped there)."""


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = GCacheStats()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def snapshot(self) -> GCacheStats:
        with self._lock:
            return GCacheStats(**asdict(self._stats))


class GCacheClient:
    """The GCache SDK (module docstring). Implements `BlockStore`."""

    def __init__(self, nats_url: str, namespace: str = subjects.DEFAULT_NAMESPACE,
                 config: GCacheConfig | None = None) -> None:
        self.nats_url = nats_url
        self.namespace = subjects.token(namespace)
        self.config = config or GCacheConfig()
        self._counters = _Counters()
        self._workers = [_IOWorker(self, i) for i in range(self.config.io_threads)]
        self._next = itertools.cycle(range(len(self._workers)))
        self._queued = 0
        self._queue_lock = threading.Lock()
        self._running = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the IO threads and connect them (bounded); then wait (up to `op_timeout_s`) for the first
        storage node to show up. No node is not an error: every call misses until one joins."""
        for worker in self._workers:
            worker.start_thread()
        try:
            await asyncio.gather(*(_hop(w.loop, w.open(), _CONNECT_TIMEOUT_S + 2 * self.config.op_timeout_s)
                                   for w in self._workers))
        except BaseException:
            await self.close()
            raise
        self._running = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.op_timeout_s):
                while not all(w.ring for w in self._workers):
                    await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop taking calls; close every IO thread's connections (bounded) and join it."""
        self._running = False
        for worker in self._workers:
            await worker.stop()

    @property
    def nodes(self) -> frozenset[str]:
        """The storage nodes on the ring of every IO thread (each keeps its own registry view)."""
        return frozenset.intersection(*(w.ring.nodes for w in self._workers))

    def home(self, key: str) -> str | None:
        """The node `key` lives on (its first successor), as the first IO thread's ring says."""
        return self._workers[0].ring.home(key)

    def stats(self) -> GCacheStats:
        stats = self._counters.snapshot()
        stats.corrupt = sum(w.direct.checksum_failures for w in self._workers if w.direct is not None)
        return stats

    # ------------------------------------------------------------------ BlockStore

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        return await self._call(lambda w: w.exists(keys), [False] * len(keys)) if keys else []

    async def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        keys = list(keys)
        misses: list[Buffer | None] = [None] * len(keys)
        if not keys:
            return []
        out = await self._call(lambda w: w.get(keys), misses)
        if out is misses:
            self._counters.add(misses=len(keys))
        return out

    async def put(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        items = list(items)
        refused = [False] * len(items)
        if not items:
            return []
        out = await self._call(lambda w: w.put(items), refused)
        if out is refused:
            self._counters.add(refused=len(items))
        return out

    def put_nowait(self, items: Sequence[tuple[str, Buffer]]) -> bool:
        """Queue a write-back batch (any thread, never blocks); False when the queue is full or the client is
        not running (the batch is dropped and counted). The values are read later, on an IO thread: pass
        `bytes`, or buffers nobody changes until written."""
        batch = list(items)
        if not batch:
            return True
        with self._queue_lock:
            if not self._running or self._queued >= self.config.write_queue:
                self._counters.add(dropped=1)
                return False
            self._queued += 1
            worker = self._workers[next(self._next)]
        try:
            worker.loop.call_soon_threadsafe(worker.enqueue, batch)
        except RuntimeError:  # its loop closed meanwhile
            self._written()
            self._counters.add(dropped=1)
            return False
        return True

    def _written(self) -> None:
        with self._queue_lock:
            self._queued -= 1

    async def _call(self, op: Callable[[_IOWorker], Coroutine[Any, Any, T]], misses: T) -> T:
        """Run `op` on an IO loop; `misses` when not running, on any failure, or past the bound."""
        if not self._running:
            return misses
        worker = self._workers[next(self._next)]
        try:
            return await _hop(worker.loop, op(worker), self.config.op_timeout_s + _GRACE_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the contract: a failure is a miss, never an exception
            self._counters.add(errors=1)
            log.warning("gcache call failed", extra={"error": repr(exc)})
            return misses


async def _hop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], timeout: float) -> T:
    """Await `coro` on `loop` (another thread's) from the caller's loop, bounded; cancelling the caller
    cancels it there too."""
    fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.wrap_future(fut)
    finally:
        fut.cancel()  # no-op when done


class _IOWorker:
    """One IO thread: its loop, NATS connection, registry view, ring, transfer engine and write-back queue."""

    def __init__(self, client: GCacheClient, index: int) -> None:
        self.client = client
        self.config = client.config
        self.index = index
        self.counters = client._counters
        self.loop = asyncio.new_event_loop()
        self.ring = HashRing(virtual_nodes=self.config.virtual_nodes)
        self.address = ""
        self.bus: Bus | None = None
        self.view: RegistryView | None = None
        self.engine: KVTransferEngine | None = None
        self.direct: DirectCalls | None = None  # the direct path (UCX engines, `GCacheConfig.direct`)
        self.addresses: dict[str, str] = {}  # node id -> its transfer address (registry entries)
        # get landing buffers: reused memory (a page fault per 4 KiB of fresh memory cost more than the bytes'
        # transfer); values larger than a segment, or beyond the arena, get fresh buffers
        lb = self.config.landing_bytes
        self.allocate = Allocator(SegmentArena(lb, min(self.config.landing_segment_bytes, lb)) if lb else None)
        if self.allocate.arena is not None and self.config.landing_prefault:
            self.allocate.arena.prefault()
        self._thread: threading.Thread | None = None
        self._queue: asyncio.Queue[list[tuple[str, Buffer]]] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ thread and connections

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"gcache-io-{self.index}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def open(self) -> None:
        cfg, client = self.config, self.client
        self.engine = create_engine()
        bound = await self.engine.start(host=cfg.transfer_host)
        self.address = advertised_address(bound, cfg.advertise_host)
        if cfg.direct and self.engine.backend is TransferBackend.UCX:
            self.direct = DirectCalls(self.engine, self.allocate, cfg.message_bytes,
                                      getattr(getattr(self.engine, "config", None), "drain_timeout_s", 2.0))
        self.bus = await Bus.connect(client.nats_url, name=f"gcache-{uuid.uuid4().hex[:8]}-{self.index}",
                                     timeout=_CONNECT_TIMEOUT_S)
        registry = await Registry.open(self.bus, bucket=subjects.registry_bucket(client.namespace))
        self.view = RegistryView(registry, Role.CACHE, ViewConfig(list_timeout_s=cfg.op_timeout_s))
        self.view.add_listener(self._on_member)
        await self.view.start()
        self._queue = asyncio.Queue()
        self._spawn(self._writer())

    async def stop(self) -> None:
        if self._thread is None:
            return
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                await _hop(self.loop, self._shutdown(), _CLOSE_TIMEOUT_S * 3)
            self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, _CLOSE_TIMEOUT_S)
        self._thread = None

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=_CLOSE_TIMEOUT_S)
        if self.view is not None:
            await self.view.stop()
        if self.engine is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                    await self.engine.close()
        if self.bus is not None:
            await self.bus.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_member(self, kind: RegistryEventKind, entry: RegistryEntry) -> None:
        iid = entry.instance_id
        if kind is not RegistryEventKind.LEAVE and entry.address:
            self.addresses[iid] = entry.address
        if kind is RegistryEventKind.JOIN and entry.address:
            self.ring.add(iid)
            log.info("gcache node joined", extra={"instance": iid, "address": entry.address})
        elif kind is RegistryEventKind.LEAVE:
            self.addresses.pop(iid, None)
            if self.ring.remove(iid):
                log.info("gcache node left", extra={"instance": iid})

    # ------------------------------------------------------------------ write-back

    def enqueue(self, batch: list[tuple[str, Buffer]]) -> None:
        if self._queue is None:
            self.client._written()
            self.counters.add(dropped=1)
            return
        self._queue.put_nowait(batch)

    async def _writer(self) -> None:
        assert self._queue is not None
        while True:
            batch = await self._queue.get()
            try:
                await self.put(batch)
            except Exception:  # put() turns node failures into False; anything else must not stop the writer
                self.counters.add(errors=1)
                log.exception("gcache write-back failed")
            finally:
                self.client._written()

    # ------------------------------------------------------------------ operations (on this loop)

    def _deadline(self) -> float:
        return self.loop.time() + self.config.op_timeout_s

    def _left(self, deadline: float) -> float:
        return max(0.001, deadline - self.loop.time())

    def _placement(self, keys: Sequence[str]) -> list[list[str]]:
        return [self.ring.successors(k, self.config.replication) for k in keys]

    async def _any_replica(self, keys: Sequence[str],
                           call: Callable[[str, list[int]], Awaitable[list[bool]]]) -> list[bool]:
        """`call(node, indices)` on every replica of the keys (batched per node); per key, True if any said so."""
        by_node = _group((i, node) for i, nodes in enumerate(self._placement(keys)) for node in nodes)
        out = [False] * len(keys)
        for idxs, answers in await self._each(by_node, call):
            for i, a in zip(idxs, answers, strict=True):
                out[i] = out[i] or a
        return out

    async def exists(self, keys: list[str]) -> list[bool]:
        deadline = self._deadline()
        return await self._any_replica(keys, lambda node, idxs: self._exists_at(node, keys, idxs, deadline))

    async def _exists_at(self, node: str, keys: list[str], idxs: list[int], deadline: float) -> list[bool]:
        assert self.bus is not None
        reply = await self.bus.request(subjects.cache_exists(self.client.namespace, node),
                                       CacheExistsRequest(keys=[keys[i] for i in idxs]), CacheExistsReply,
                                       timeout=self._left(deadline))
        if len(reply.present) != len(idxs):
            raise ValueError(f"node {node}: {len(reply.present)} answers for {len(idxs)} keys")
        return reply.present

    async def get(self, keys: list[str]) -> list[Buffer | None]:
        deadline = self._deadline()
        placed = self._placement(keys)
        out: list[Buffer | None] = [None] * len(keys)
        for rank in range(self.config.replication):
            by_node = _group((i, nodes[rank]) for i, nodes in enumerate(placed)
                             if out[i] is None and len(nodes) > rank)
            if not by_node:
                break
            for idxs, values in await self._each(by_node, lambda node, idxs: self._get_at(node, keys, idxs,
                                                                                       deadline)):
                for i, v in zip(idxs, values, strict=True):
                    out[i] = v
        hits = [v for v in out if v is not None]
        self.counters.add(hits=len(hits), misses=len(out) - len(hits), bytes_read=sum(len(v) for v in hits))
        return out

    def _direct_address(self, node: str) -> str | None:
        """The node's transfer address when this call may take the direct path (a UCX engine on both ends)."""
        address = self.addresses.get(node)
        if self.direct is None or address is None or not address.startswith("ucx://"):
            return None
        return address

    async def _get_at(self, node: str, keys: list[str], idxs: list[int], deadline: float) -> list[Buffer | None]:
        assert self.bus is not None and self.engine is not None
        address = self._direct_address(node)
        if address is not None and self.direct is not None:
            with contextlib.suppress(DirectUnreachable):  # (then the NATS path: its reply names the address)
                return await self.direct.get(address, [keys[i] for i in idxs], deadline)
        tid = uuid.uuid4().hex
        landing = _Landing(self.allocate)
        incoming = self.engine.expect(tid, landing.allocate)
        try:
            async with asyncio.timeout(self._left(deadline)):
                req = CacheGetRequest(transfer_id=tid, keys=[keys[i] for i in idxs], address=self.address,
                                      chunk_bytes=self.config.chunk_bytes)
                reply = await self.bus.request(subjects.cache_get(self.client.namespace, node), req, CacheGetReply,
                                               timeout=self._left(deadline))
                if len(reply.sizes) != len(idxs):
                    raise ValueError(f"node {node}: {len(reply.sizes)} sizes for {len(idxs)} keys")
                if any(s > 0 for s in reply.sizes):
                    await incoming.wait(timeout=self._left(deadline))
            return landing.values(reply.sizes)
        finally:
            if not incoming.state.terminal:  # no transfer came (all missed) or we gave up: free the slot
                self._spawn(self.engine.cancel(tid, "gcache get ended"))

    async def put(self, items: list[tuple[str, Buffer]]) -> list[bool]:
        deadline = self._deadline()
        sums = _PutChecksums(items)
        out = await self._any_replica([k for k, _ in items],
                                      lambda node, idxs: self._put_at(node, items, sums, idxs, deadline))
        stored_n = sum(out)
        self.counters.add(stored=stored_n, refused=len(out) - stored_n,
                          bytes_written=sum(len(items[i][1]) for i, s in enumerate(out) if s))
        return out

    async def _put_at(self, node: str, items: list[tuple[str, Buffer]], sums: _PutChecksums, idxs: list[int],
                      deadline: float) -> list[bool]:
        assert self.bus is not None and self.engine is not None
        address = self._direct_address(node)
        if address is not None and self.direct is not None:
            async def mine() -> list[int]:
                every = await asyncio.shield(sums.get())
                return [every[i] for i in idxs]
            with contextlib.suppress(DirectUnreachable):  # (then the NATS path: its reply names the address)
                return await self.direct.put(address, [items[i] for i in idxs], deadline, mine)
        tid = uuid.uuid4().hex
        chunk = self.config.chunk_bytes
        async with asyncio.timeout(self._left(deadline)):
            checksums = await asyncio.shield(sums.get())
        req = CachePutRequest(transfer_id=tid, chunk_bytes=chunk, items=[
            CachePutItem(key=items[i][0], size=len(items[i][1]), checksum=checksums[i]) for i in idxs])
        reply = await self.bus.request(subjects.cache_put(self.client.namespace, node), req, CachePutReply,
                                       timeout=self._left(deadline))
        if len(reply.accepted) != len(idxs):
            raise ValueError(f"node {node}: {len(reply.accepted)} answers for {len(idxs)} items")
        taken = [(pos, items[i][1]) for pos, (i, ok) in enumerate(zip(idxs, reply.accepted, strict=True))
                 if ok and len(items[i][1])]
        if taken:
            specs = wire.layer_specs([len(v) for _, v in taken], chunk, [pos for pos, _ in taken])
            payloads = [view for _, v in taken for view in wire.chunk_views(v, chunk)]
            async with asyncio.timeout(self._left(deadline)):
                await self.engine.send(reply.address, tid, specs, payloads)
        return list(reply.accepted)

    async def _each(self, by_node: dict[str, list[int]],
                    call: Callable[[str, list[int]], Awaitable[list[T]]]) -> list[tuple[list[int], list[T]]]:
        """`call` per node and per batch of at most MAX_BATCH indices, concurrently; a batch that fails is left
        out (its keys stay misses) and counted."""
        batches = [(node, idxs[j:j + MAX_BATCH]) for node, idxs in by_node.items()
                   for j in range(0, len(idxs), MAX_BATCH)]
        results = await asyncio.gather(*(call(node, idxs) for node, idxs in batches), return_exceptions=True)
        out: list[tuple[list[int], list[T]]] = []
        for (node, idxs), res in zip(batches, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, _NODE_FAILURES):
                    raise res
                self.counters.add(errors=1)
                log.info("gcache node failed: its keys are misses",
                         extra={"instance": node, "keys": len(idxs), "error": repr(res)})
                continue
            out.append((idxs, res))
        return out


class _PutChecksums:
    """A put's checksums (the NATS path's request carries them; the direct path sends them after the values):
    hashed once, on a thread (xxhash releases the GIL), when a replica first needs them."""

    def __init__(self, items: list[tuple[str, Buffer]]) -> None:
        self._items = items
        self._fut: asyncio.Future[list[int]] | None = None

    def get(self) -> asyncio.Future[list[int]]:
        if self._fut is None:
            self._fut = asyncio.ensure_future(asyncio.to_thread(lambda: [value_checksum(v) for _, v in self._items]))
        return self._fut


class _Landing:
    """Buffers of one get's incoming transfer, laid out from its header: one uninitialised buffer per value (no
    zero fill: every byte is received) from the IO thread's allocator (its arena: memory faulted once and
    reused, libs/gcache/arena.py), each chunk layer a tensor over a slice of it; the values handed out are
    memoryviews of those buffers (no copy after the bytes land)."""

    def __init__(self, allocate: Callable[[int], memoryview]) -> None:
        self.allocate_value = allocate
        self.buffers: dict[int, memoryview] = {}

    def allocate(self, header: TransferHeader) -> list[torch.Tensor]:
        sizes = wire.value_sizes(header.layers)
        self.buffers = {pos: self.allocate_value(size) for pos, size in sizes.items()}
        tensors = {pos: torch.frombuffer(buf, dtype=torch.uint8) for pos, buf in self.buffers.items()}
        offsets = dict.fromkeys(sizes, 0)
        views = []
        for spec in header.layers:
            n, pos = spec.shape[0], spec.layer_index
            views.append(tensors[pos][offsets[pos]:offsets[pos] + n])
            offsets[pos] += n
        return views

    def values(self, sizes: list[int]) -> list[Buffer | None]:
        """The values in request order, by the reply's sizes (-1: a miss; a value whose bytes did not come as
        announced is a miss too)."""
        out: list[Buffer | None] = []
        for pos, size in enumerate(sizes):
            if size == 0:
                out.append(b"")
            elif size > 0 and len(self.buffers.get(pos, b"")) == size:
                out.append(self.buffers[pos])
            else:
                out.append(None)
        return out


def _group(pairs: Any) -> dict[str, list[int]]:
    by: dict[str, list[int]] = {}
    for i, node in pairs:
        by.setdefault(node, []).append(i)
    return by
