"""The storage node's side of the direct path (`libs.gcache.direct`; docs/gcache.md, "The direct path").

`DirectNode` serves MESSAGE requests from the transfer engine's control connections, with the NATS path's
guarantees over the same `NodeStore`: a put is visible only once every value landed and the client's sums
came (they become the checksums; the node does not hash puts); a client's dropped connection aborts its
puts at once; values or sums missing past `put_timeout_s` abort the put and drop the connection. A get
answers the sizes, sends every found value at once and verifies memory values while they go: a failed one
is dropped, counted and named, so the client never returns it; sends pending past `send_timeout_s` drop
the connection.
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
    DirectError,
    decode,
    encode,
    int_list,
    scratch,
    str_list,
    tagged_link,
)
from libs.transfer import PeerDisconnected, TransferError
from libs.transfer.connection import Connection
from libs.transfer.protocol import message_tag
from services.gcache import metrics
from services.gcache.handlers import CacheNode, mismatches
from services.gcache.store import Found, PutSlot

log = logging.getLogger("windserve.cache")

Spawn = Callable[[Coroutine[Any, Any, Any], str], object]


class _DirectPut:
    def __init__(self, conn: Connection, msg_id: int, slots: list[PutSlot | None]) -> None:
        self.conn, self.msg_id, self.slots = conn, msg_id, slots
        self.requests: list[asyncio.Future] = []
        self.sums: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
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
        self._puts: dict[int, set[_DirectPut]] = {}  # by id(connection)
        self._by_id: dict[tuple[int, int], _DirectPut] = {}  # by (id(connection), message id)
        self._scratch: list[np.ndarray] = []
        self.puts = 0  # direct requests served (health)
        self.gets = 0
        engine.set_message_handler(self.on_message)
        engine.add_drop_listener(self.on_drop)

    # ------------------------------------------------------------------ dispatch

    def on_message(self, conn: Connection, msg_id: int, body: bytes) -> None:
        try:
            msg = decode(body)
            op = msg.get("op")
            tagged_link(conn)  # (DirectError: the direct path needs a UCX engine)
            if op == "sums":
                self._sums(conn, msg_id, msg)
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
                # (a refused item is drained into scratch memory, never stored)
                views = wire.chunk_arrays(slot.buffer, chunk) if slot is not None else [
                    scratch(n, self._scratch) for n in wire.chunk_sizes(size, chunk)]
                for view in views:
                    put.requests.append(link.post_recv(message_tag(link.nonce, msg_id, index), view))
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
            _, pending = await asyncio.wait([*put.requests, put.sums], timeout=self.config.put_timeout_s)
            if put.over:  # the connection dropped, or the sums were garbage: aborted already
                return
            if pending:
                self._abort(put, f"values or sums did not come within {self.config.put_timeout_s:.3g}s")
                if any(not r.done() for r in put.requests):  # only closing the endpoint cancels the receives
                    await put.conn.drop(PeerDisconnected(f"direct put from {put.conn.peer} timed out"))
                return
            if any(r.cancelled() or r.exception() is not None for r in put.requests):
                self._abort(put, "receiving a value failed")
                return
        except asyncio.CancelledError:
            self._abort(put, "node shutting down")
            raise
        put.over = True
        self._forget(put)
        stored = []
        for slot, checksum in zip(put.slots, put.sums.result(), strict=True):
            if slot is None:
                stored.append(False)
                continue
            slot.checksum = checksum  # (the writer's hash of its bytes: verified on every read)
            ok = self.store.commit(slot, digest=checksum)
            metrics.PUTS.labels("committed" if ok else "dropped").inc()
            if not ok:
                log.warning("put dropped at commit (reaped meanwhile)", extra={"key": slot.key})
            stored.append(ok)
        metrics.BYTES.labels("in").inc(sum(s.size for s in put.slots if s is not None))
        self._reply(put.conn, put.msg_id, {"stored": stored})

    def _sums(self, conn: Connection, msg_id: int, msg: dict[str, Any]) -> None:
        """A put's checksums, sent by the client once it hashed its values (they come after the put request on
        the same connection); garbage aborts the put."""
        put = self._by_id.get((id(conn), msg_id))
        if put is None:  # (aborted meanwhile: the client was told, and forgot the call)
            raise DirectError(f"no put {msg_id} in flight on this connection")
        if put.sums.done():
            return
        try:
            put.sums.set_result(int_list(msg, "sums", len(put.slots)))
        except DirectError as exc:
            self._abort(put, str(exc))
            put.sums.cancel()

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
        self._reply(put.conn, put.msg_id, {"error": f"put aborted: {why}"})

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
        unverified = [(pos, v) for pos, v in enumerate(values) if v is not None and len(v.data) and not v.verified]
        self.gets += 1
        self._reply(conn, msg_id, {"sizes": [-1 if v is None else len(v.data) for v in values],
                                   "check": bool(unverified)})
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
        if unverified:
            self._spawn(self._verify(conn, msg_id, keys, unverified), f"direct-verify-{msg_id}")
        self.node.inflight_gets += 1
        self._spawn(self._finish_get(conn, sends, sum(len(v.data) for v in found)), f"direct-get-{msg_id}")

    async def _verify(self, conn: Connection, msg_id: int, keys: list[str], values: list[tuple[int, Found]]) -> None:
        """Hash the memory values a get is sending (a thread: xxhash releases the GIL); drop those that fail and
        name them in the verdict, which the client waits for before it returns any value."""
        bad = await asyncio.to_thread(mismatches, values)
        for pos, v in bad:
            self.store.failed_verification(keys[pos], v)
        if bad:
            log.warning("get: values failed their checksum (dropped)", extra={"keys": [keys[p] for p, _ in bad]})
        self._reply(conn, msg_id, {"bad": [pos for pos, _ in bad]})

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
