"""The storage node's side of the direct path (`libs.gcache.direct`; docs/gcache.md, "The direct path").

Requests arrive as MESSAGE frames on the transfer engine's control connections (one per client IO thread);
values move as one tagged UCX message per chunk on that connection's endpoint. The guarantees are the NATS
path's (`handlers.CacheNode`), over the same `NodeStore`:

- **put**: `begin_put` per item, then at once a receive posted per chunk (into the slot's buffer; a refused
  item's chunks into scratch memory, so the client's sends complete and nothing is stored). Each accepted value
  is hashed chunk by chunk, in order, as its chunks land, on one hashing thread (xxhash releases the GIL): when
  the last chunk lands only that chunk is left to hash, and the node's loop never hashes. When every chunk
  landed the slots are committed with their digests as their checksums and the client is told what was stored.
  Nothing is visible before its commit. If the client's connection drops (it died) every put of that
  connection is aborted at once (the link closed first: no receive can land afterwards); if the chunks do not
  land within `put_timeout_s` the put is aborted and the connection dropped (which cancels the posted
  receives); `reap` stays the backstop.
- **get**: the store's values (`lookup`: a disk value verified on read), the sizes and the memory values'
  checksums answered at once, every chunk of the found values sent at once. The client hashes what lands and
  reports a mismatch (`op: bad`); the node hashes those values again (its hashing thread) and drops the ones
  that fail there too, counting a checksum failure. Sends still pending after `send_timeout_s` drop the
  connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from libs.gcache import wire
from libs.gcache.direct import (
    MAX_CHUNK_BYTES,
    ChunkHasher,
    DirectError,
    decode,
    encode,
    hashing_pool,
    scratch,
    str_list,
    tagged_link,
)
from libs.transfer import PeerDisconnected, TransferError
from libs.transfer.connection import Connection
from libs.transfer.protocol import message_tag
from services.cache import metrics
from services.cache.handlers import CacheNode, mismatches
from services.cache.store import Found, PutSlot

log = logging.getLogger("windserve.cache")

Spawn = Callable[[Coroutine[Any, Any, Any], str], object]


class _DirectPut:
    def __init__(self, conn: Connection, msg_id: int, slots: list[PutSlot | None]) -> None:
        self.conn, self.msg_id, self.slots = conn, msg_id, slots
        self.requests: list[asyncio.Future] = []
        self.hashers: list[ChunkHasher | None] = []
        self.task: asyncio.Future[Any] | None = None
        self.over = False


class DirectNode:
    """Serves direct puts and gets on `node`'s store over its (UCX) transfer engine; `spawn` runs the waits in
    the service's task set (shutdown cancels them)."""

    def __init__(self, node: CacheNode, engine: Any, spawn: Spawn) -> None:
        self.node = node
        self.store = node.store
        self.config = node.config
        self._spawn = spawn
        self._pool = hashing_pool("cache-hash")
        self._puts: dict[int, set[_DirectPut]] = {}  # by id(connection)
        self._by_id: dict[tuple[int, int], _DirectPut] = {}  # by (id(connection), message id)
        self._scratch: list[np.ndarray] = []
        self.puts = 0  # direct requests served (health)
        self.gets = 0
        engine.set_message_handler(self.on_message)
        engine.add_drop_listener(self.on_drop)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ dispatch

    def on_message(self, conn: Connection, msg_id: int, body: bytes) -> None:
        try:
            msg = decode(body)
            op = msg.get("op")
            tagged_link(conn)  # (DirectError: the direct path needs a UCX engine)
            if op == "bad":
                self._bad(msg)
                return
            chunk = msg.get("chunk")
            if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 < chunk <= MAX_CHUNK_BYTES:
                raise DirectError(f"bad chunk size {chunk!r}")
            if op == "put":
                self._put(conn, msg_id, msg, chunk)
            elif op == "get":
                self._get(conn, msg_id, msg, chunk)
            else:
                raise DirectError(f"unknown op {op!r}")
        except (DirectError, ValueError, TypeError) as exc:
            log.info("direct request refused", extra={"peer": conn.peer, "error": str(exc)})
            self._reply(conn, msg_id, {"error": str(exc)})
        except TransferError as exc:  # the link closed under us: the drop fails the rest
            log.info("direct request on a closed link", extra={"peer": conn.peer, "error": str(exc)})

    def _reply(self, conn: Connection, msg_id: int, msg: dict[str, Any]) -> None:
        try:
            conn.post_message(msg_id, encode(msg))
        except TransferError:
            pass  # the client is gone: nothing to tell

    # ------------------------------------------------------------------ put

    def _put(self, conn: Connection, msg_id: int, msg: dict[str, Any], chunk: int) -> None:
        items = msg.get("items")
        if not isinstance(items, list) or not all(
                isinstance(it, list) and len(it) == 2 and isinstance(it[0], str) and isinstance(it[1], int)
                and not isinstance(it[1], bool) and it[1] >= 0 for it in items):
            raise DirectError("put items must be [key, size >= 0] lists")
        if (id(conn), msg_id) in self._by_id:
            raise DirectError(f"put {msg_id} is already in flight on this connection")
        # (each slot's checksum is the digest of the bytes that land, set at commit)
        slots = [self.store.begin_put(key, size, 0) for key, size in items]
        taken = [s for s in slots if s is not None]
        metrics.PUTS.labels("accepted").inc(len(taken))
        metrics.PUTS.labels("refused").inc(len(slots) - len(taken))
        self.puts += 1
        put = _DirectPut(conn, msg_id, slots)
        link, index = tagged_link(conn), 0
        try:
            for (_, size), slot in zip(items, slots, strict=True):
                if slot is not None:
                    views = wire.chunk_arrays(slot.buffer, chunk)
                    hasher = ChunkHasher(views, self._pool)
                    put.hashers.append(hasher)
                    for k, view in enumerate(views):
                        fut = link.post_recv(message_tag(link.nonce, msg_id, index), view)
                        fut.add_done_callback(hasher.when_landed(k))
                        put.requests.append(fut)
                        index += 1
                else:
                    put.hashers.append(None)
                    for n in wire.chunk_sizes(size, chunk):  # refused: drained, never stored
                        put.requests.append(link.post_recv(message_tag(link.nonce, msg_id, index),
                                                           scratch(n, self._scratch)))
                        index += 1
        except BaseException:
            self._abort(put, "posting the receives failed")
            raise
        self._puts.setdefault(id(conn), set()).add(put)
        self._by_id[(id(conn), msg_id)] = put
        task = self._spawn(self._finish_put(put), f"direct-put-{msg_id}")
        put.task = task if isinstance(task, asyncio.Future) else None

    async def _finish_put(self, put: _DirectPut) -> None:
        try:
            if put.requests:
                _, pending = await asyncio.wait(put.requests, timeout=self.config.put_timeout_s)
                if pending:  # only closing the endpoint cancels the posted receives
                    self._abort(put, f"chunks did not land within {self.config.put_timeout_s:.3g}s")
                    await put.conn.drop(PeerDisconnected(f"direct put from {put.conn.peer} timed out"))
                    return
                failed = [r for r in put.requests if r.cancelled() or r.exception() is not None]
                if failed:
                    self._abort(put, "receiving a chunk failed")
                    return
            digests = [await h.digest() if h is not None else None for h in put.hashers]
        except asyncio.CancelledError:
            self._abort(put, "node shutting down")
            raise
        if put.over:  # the connection dropped meanwhile: aborted already
            return
        put.over = True
        self._forget(put)
        stored = []
        for slot, digest in zip(put.slots, digests, strict=True):
            if slot is None or digest is None:
                stored.append(False)
                continue
            slot.checksum = digest
            ok = self.store.commit(slot, digest=digest)
            metrics.PUTS.labels("committed" if ok else "dropped").inc()
            if not ok:
                log.warning("put dropped at commit (reaped meanwhile)", extra={"key": slot.key})
            stored.append(ok)
        metrics.BYTES.labels("in").inc(sum(s.size for s in put.slots if s is not None))
        self._reply(put.conn, put.msg_id, {"stored": stored})

    def _abort(self, put: _DirectPut, why: str) -> None:
        if put.over:
            return
        put.over = True
        self._forget(put)
        taken = [s for s in put.slots if s is not None]
        for slot in taken:
            self.store.abort(slot)
        metrics.PUTS.labels("aborted").inc(len(taken))
        log.info("direct put aborted", extra={"values": len(taken), "error": why})

    def _forget(self, put: _DirectPut) -> None:
        self._by_id.pop((id(put.conn), put.msg_id), None)
        puts = self._puts.get(id(put.conn))
        if puts is not None:
            puts.discard(put)
            if not puts:
                del self._puts[id(put.conn)]

    def on_drop(self, conn: Connection, err: TransferError) -> None:
        """The client's connection closed (it died, or a bound dropped it): its puts are aborted now (the link
        closed before this is called, so none of their receives can still land)."""
        for put in list(self._puts.get(id(conn), ())):
            self._abort(put, str(err))
            if put.task is not None:
                put.task.cancel()

    # ------------------------------------------------------------------ get

    def _get(self, conn: Connection, msg_id: int, msg: dict[str, Any], chunk: int) -> None:
        keys = str_list(msg, "keys")
        values = self.node.lookup_all(keys)
        found = [v for v in values if v is not None and len(v.data)]
        self.gets += 1
        # the client verifies what it receives against these sums (null: verified here already, or nothing)
        self._reply(conn, msg_id, {"sizes": [-1 if v is None else len(v.data) for v in values],
                                   "sums": [v.checksum if v is not None and len(v.data) and not v.verified
                                            else None for v in values]})
        if not found:
            return
        link, index, sends = tagged_link(conn), 0, []
        try:
            for v in found:
                for view in wire.chunk_arrays(v.data, chunk):
                    sends.append(link.post_send(message_tag(link.nonce, msg_id, index), view))
                    index += 1
        except TransferError as exc:
            log.info("direct get: sending failed", extra={"peer": conn.peer, "error": str(exc)})
        self.node.inflight_gets += 1
        self._spawn(self._finish_get(conn, sends, sum(len(v.data) for v in found)), f"direct-get-{msg_id}")

    async def _finish_get(self, conn: Connection, sends: list[asyncio.Future], nbytes: int) -> None:
        try:
            if sends:
                _, pending = await asyncio.wait(sends, timeout=self.config.send_timeout_s)
                if pending:  # the client is gone or stuck: closing the endpoint cancels the sends
                    metrics.SEND_FAILURES.inc()
                    await conn.drop(PeerDisconnected(f"direct get sends to {conn.peer} did not complete"))
                    return
                if any(s.cancelled() or s.exception() is not None for s in sends):
                    metrics.SEND_FAILURES.inc()
                    return
            metrics.BYTES.labels("out").inc(nbytes)
        finally:
            self.node.inflight_gets -= 1

    def _bad(self, msg: dict[str, Any]) -> None:
        """A client's report of values whose bytes failed their checksum: hash them again (the hashing thread)
        and drop those that fail here too (a client's word alone drops nothing)."""
        suspects = [(k, v) for k in str_list(msg, "keys") if (v := self.store.peek(k)) is not None]
        if suspects:
            self._spawn(self._recheck(suspects), "direct-recheck")

    async def _recheck(self, suspects: list[tuple[str, Found]]) -> None:
        bad = await asyncio.wrap_future(self._pool.submit(mismatches, suspects))
        for key, v in bad:
            self.store.failed_verification(key, v)
        if bad:
            log.warning("get: values failed their checksum (dropped)", extra={"keys": [k for k, _ in bad]})
