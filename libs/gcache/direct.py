"""The direct path: puts and gets without NATS or transfer headers (docs/gcache.md, "The direct path").

On a UCX transfer engine a client's put or get to one node is

- one MESSAGE frame (`libs.transfer`, "Messages") on the engine's persistent control connection to the node
  (dialled once per (IO thread, node), cached by the engine; its UCX endpoint comes with it), and
- one tagged UCX message per chunk of every value, on that connection's endpoint, tag
  `message_tag(connection nonce, message id, chunk index)` (chunk index: running over the batch's chunks in
  value order; values of 0 bytes have none),

with no HEADER / ACCEPT round trip, no LAYER frames, no END / DONE:

```
put   client ── MESSAGE {op: put, chunk, items[key, size]} ──▶ node: begin_put per item, a receive posted
                                                                  per chunk (a refused item's into scratch
             ══ every chunk of every item, sent at once ══▶        memory), each chunk hashed in order as it
                                                                  lands (a thread): every chunk landed →
             ◀── MESSAGE {stored[]} ──                            commit with that digest as the checksum
get   client ── MESSAGE {op: get, chunk, keys} ──▶ node: lookup; reply at once, send every chunk at once
             ◀── MESSAGE {sizes[], sums[]} ──      (a disk value verified on read: its sum null)
             ◀══ the found values' chunks ══       client: receives posted as the reply arrives, each chunk
                                                   hashed in order as it lands (a thread); a value whose
             ── MESSAGE {op: bad, keys} ──▶        digest is not its sum is a miss, and reported: the node
                                                   hashes it again and drops it if it fails there too
```

Each value is hashed once per put and once per get, by the side that receives it, chunk by chunk as its chunks
land (still in the CPU cache), so only the last chunk's hash follows the transfer.

This module holds the message codec and `ChunkHasher` (both sides) and `DirectCalls`, the client side of one IO
thread.

Failure contract: a call fails (its keys become misses) when the control connection drops (the node died: its
socket closes at once, which shared-memory UCX cannot report), when the node answers an error or nonsense,
or past the caller's deadline. A failed call's posted receives and issued sends are given `drain_timeout_s` to
finish; if they do not, the connection is dropped, which closes the endpoint and cancels them — so no buffer
is read or written by UCX after that (a landing buffer is referenced until then, so the arena cannot reuse
it). A reply to a call that was given up (its get's sizes) is drained into scratch memory, so the node's sends
never stay pending.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from libs.transfer import PeerDisconnected, TransferError
from libs.transfer.backends.ucx import UcxLink
from libs.transfer.connection import Connection
from libs.transfer.protocol import message_tag

from . import wire
from .api import Buffer
from .keys import checksum_state

log = logging.getLogger("windserve.gcache")

MAX_CHUNK_BYTES = 1 << 30  # a chunk size a node accepts at most


class DirectError(TransferError):
    """The node refused or garbled a direct call (its keys are misses)."""


class DirectUnreachable(PeerDisconnected):
    """No control connection to the node's address could be made (nothing was sent): the caller may take the
    NATS path, whose reply names the node's current address (a node restarted under the same id)."""


def encode(msg: dict[str, Any]) -> bytes:
    return orjson.dumps(msg)


def decode(body: bytes) -> dict[str, Any]:
    """The message object, or DirectError when `body` is not a JSON object."""
    try:
        msg = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise DirectError(f"direct message is not JSON: {exc}") from exc
    if not isinstance(msg, dict):
        raise DirectError(f"direct message must be an object, got {type(msg).__name__}")
    return msg


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _list_of(msg: dict[str, Any], name: str, what: str, ok: Callable[[object], bool], n: int | None) -> list[Any]:
    """Field `name` of a direct message, checked: a list whose items all pass `ok` (`what` names them), of `n`
    entries when given; DirectError otherwise."""
    value = msg.get(name)
    if not isinstance(value, list) or not all(ok(x) for x in value):
        raise DirectError(f"direct message field {name!r} must be a list of {what}, got {value!r:.80}")
    if n is not None and len(value) != n:
        raise DirectError(f"direct message field {name!r}: {len(value)} entries for {n}")
    return value


def int_list(msg: dict[str, Any], name: str, n: int | None = None) -> list[int]:
    return _list_of(msg, name, "ints", _is_int, n)


def str_list(msg: dict[str, Any], name: str) -> list[str]:
    return _list_of(msg, name, "strings", lambda x: isinstance(x, str), None)


def bool_list(msg: dict[str, Any], name: str, n: int) -> list[bool]:
    return _list_of(msg, name, "bools", lambda x: isinstance(x, bool), n)


def sum_list(msg: dict[str, Any], name: str, n: int) -> list[int | None]:
    """Checksums: ints, or null for a value with nothing to verify."""
    return _list_of(msg, name, "ints or nulls", lambda x: x is None or _is_int(x), n)


def tagged_link(conn: Connection) -> UcxLink:
    """The connection's UCX link (tagged payloads), or DirectError: the direct path needs a UCX engine."""
    if not isinstance(conn.link, UcxLink):
        raise DirectError(f"the connection to {conn.peer} has no tagged data plane (not UCX)")
    return conn.link


def scratch(nbytes: int, cache: list[np.ndarray]) -> np.ndarray:
    """`nbytes` of throwaway memory to drain a payload nobody wants into (one buffer, grown as needed and shared
    by every drain: what lands there is never read)."""
    if not cache or len(cache[0]) < nbytes:
        cache[:] = [np.empty(max(nbytes, 1), dtype=np.uint8)]
    return cache[0][:nbytes]


class ChunkHasher:
    """The checksum (`value_checksum`) of one value received as chunks: each chunk is hashed on `pool` (one
    thread: xxhash releases the GIL) once it and every chunk before it landed, so that when the last chunk lands
    only it is left to hash."""

    def __init__(self, views: list[np.ndarray], pool: concurrent.futures.Executor) -> None:
        self._views = views
        self._pool = pool
        self._state = checksum_state()
        self._landed: set[int] = set()
        self._next = 0
        self._last: concurrent.futures.Future[None] | None = None

    def landed(self, k: int) -> None:
        self._landed.add(k)
        while self._next in self._landed:
            self._last = self._pool.submit(self._state.update, self._views[self._next].data)
            self._next += 1

    def when_landed(self, k: int) -> Callable[[asyncio.Future[Any]], None]:
        """The done callback of chunk `k`'s receive: hash it (and what it unblocks) once it landed intact."""
        def done(fut: asyncio.Future[Any]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                self.landed(k)
        return done

    async def digest(self) -> int:
        """Once every chunk landed: the value's checksum."""
        assert self._next == len(self._views), "digest before every chunk landed"
        if self._last is not None:
            await asyncio.wrap_future(self._last)  # (one thread, FIFO: every update before it is done too)
        return self._state.intdigest()


def hashing_pool(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that hashes a side's landed chunks (FIFO: `ChunkHasher` relies on it)."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)


async def _all_done(requests: list[asyncio.Future], timeout: float) -> None:
    """Wait for UCX requests without ever cancelling one (a cancelled Python wait would leave its UCX request
    posted: only closing the endpoint cancels that); TimeoutError past `timeout`, a failed request's error."""
    if not requests:
        return
    done, pending = await asyncio.wait(requests, timeout=timeout)
    if pending:
        raise TimeoutError(f"{len(pending)} of {len(requests)} UCX requests still pending")
    for r in done:
        if r.cancelled():
            raise TransferError("UCX request cancelled")
        if r.exception() is not None:
            raise TransferError(f"UCX request failed: {r.exception()!r}")


@dataclass
class _DirectCall:
    conn: Connection
    msg_id: int
    reply: asyncio.Future[dict[str, Any]]
    requests: list[asyncio.Future] = field(default_factory=list)  # UCX sends / receives posted for it

    def fail(self, exc: BaseException) -> None:
        if not self.reply.done():
            self.reply.set_exception(exc)
            self.reply.exception()  # (retrieved: a reply nobody waits for is no news)


class DirectCalls:
    """The direct path of one IO thread over its (UCX) transfer engine: `put` and `get` to a node's address.
    Registers the engine's message handler and a drop listener; one owner loop."""

    def __init__(self, engine: Any, allocate: Callable[[int], memoryview], chunk_bytes: int,
                 drain_timeout_s: float = 2.0) -> None:
        self.engine = engine
        self.allocate = allocate
        self.chunk_bytes = chunk_bytes
        self.drain_timeout_s = drain_timeout_s
        self._ids = itertools.count(1)
        self._calls: dict[tuple[int, int], _DirectCall] = {}
        self._scratch: list[np.ndarray] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pool = hashing_pool("gcache-hash")
        self.calls = 0  # direct calls made (tests, health)
        self.drops = 0  # connections dropped because a failed call's UCX requests did not drain
        self.checksum_failures = 0  # values got whose bytes did not match their checksum (misses; reported)
        engine.set_message_handler(self._on_message)
        engine.add_drop_listener(self._on_drop)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ calls

    async def put(self, address: str, items: Sequence[tuple[str, Buffer]], deadline: float) -> list[bool]:
        """Store `items` (key, value) on the node at `address`; per item, whether it stored it. The request and
        the chunks go at once; the node checksums each value from the bytes that landed."""
        conn = await self._connect(address, deadline)
        call = self._open(conn)
        chunk = self.chunk_bytes
        try:
            conn.post_message(call.msg_id, encode({"op": "put", "chunk": chunk, "items": [
                [key, len(value)] for key, value in items]}))
            link, index = tagged_link(conn), 0
            for _, value in items:
                for view in wire.chunk_arrays(value, chunk):
                    call.requests.append(link.post_send(message_tag(link.nonce, call.msg_id, index), view))
                    index += 1
            async with asyncio.timeout(self._left(deadline)):
                reply = await call.reply
            await _all_done(call.requests, self._left(deadline))  # (by now: the node took or drained every chunk)
            return bool_list(reply, "stored", len(items))
        finally:
            self._close(call)

    async def get(self, address: str, keys: Sequence[str], deadline: float) -> list[Buffer | None]:
        """The values of `keys` on the node at `address` (None: a miss there, or a value whose bytes did not
        match its checksum: counted and reported to the node)."""
        conn = await self._connect(address, deadline)
        call = self._open(conn)
        chunk = self.chunk_bytes
        try:
            conn.post_message(call.msg_id, encode({"op": "get", "chunk": chunk, "keys": list(keys)}))
            async with asyncio.timeout(self._left(deadline)):
                reply = await call.reply
            sizes = int_list(reply, "sizes", len(keys))
            sums = sum_list(reply, "sums", len(keys))
            buffers, hashers = self._post_receives(call, sizes, sums)
            await _all_done(call.requests, self._left(deadline))
            async with asyncio.timeout(self._left(deadline)):
                bad = {pos for pos, h in hashers.items() if await h.digest() != sums[pos]}
            if bad:
                self.checksum_failures += len(bad)
                log.warning("gcache get: values failed their checksum (misses; reported to the node)",
                            extra={"peer": conn.peer, "keys": [keys[i] for i in sorted(bad)]})
                with contextlib.suppress(TransferError):  # (the node is gone: nothing to tell)
                    conn.post_message(next(self._ids), encode({"op": "bad", "keys": [keys[i] for i in sorted(bad)]}))
            out: list[Buffer | None] = []
            for pos, size in enumerate(sizes):
                if size == 0:
                    out.append(b"")
                elif size > 0 and pos not in bad:
                    out.append(buffers[pos])
                else:
                    out.append(None)
            return out
        finally:
            self._close(call)

    # ------------------------------------------------------------------ plumbing

    def _post_receives(self, call: _DirectCall, sizes: list[int], sums: list[int | None]
                       ) -> tuple[dict[int, memoryview], dict[int, ChunkHasher]]:
        """A landing buffer per value (the IO thread's arena) and a receive posted per chunk, in value order;
        a value with a sum is hashed chunk by chunk as it lands."""
        link, index = tagged_link(call.conn), 0
        buffers: dict[int, memoryview] = {}
        hashers: dict[int, ChunkHasher] = {}
        for pos, size in enumerate(sizes):
            if size <= 0:
                continue
            buffers[pos] = buf = self.allocate(size)
            views = wire.chunk_arrays(buf, self.chunk_bytes)
            hasher = ChunkHasher(views, self._pool) if sums[pos] is not None else None
            if hasher is not None:
                hashers[pos] = hasher
            for k, view in enumerate(views):
                fut = link.post_recv(message_tag(link.nonce, call.msg_id, index), view)
                if hasher is not None:
                    fut.add_done_callback(hasher.when_landed(k))
                call.requests.append(fut)
                index += 1
        return buffers, hashers

    async def _connect(self, address: str, deadline: float) -> Connection:
        try:
            async with asyncio.timeout(self._left(deadline)):
                conn = await self.engine.connect(address)
        except (PeerDisconnected, OSError) as exc:
            raise DirectUnreachable(f"cannot reach {address}: {exc}") from exc
        tagged_link(conn)
        return conn

    def _open(self, conn: Connection) -> _DirectCall:
        loop = asyncio.get_running_loop()
        call = _DirectCall(conn, next(self._ids), loop.create_future())
        self._calls[(id(conn), call.msg_id)] = call
        self.calls += 1
        return call

    def _close(self, call: _DirectCall) -> None:
        """The call is over here: forget it; a get's reply nobody took has its values drained (as an orphan's);
        UCX requests still pending get the drain bound, then the connection is dropped (which cancels them)."""
        self._calls.pop((id(call.conn), call.msg_id), None)
        reply = call.reply
        if reply.done() and not reply.cancelled() and reply.exception() is None and not call.requests:
            # the reply came, but the deadline struck before the caller took it (its wake-up was already
            # scheduled) and posted no receive: its values are on their way all the same (a put's reply or a get
            # with nothing to receive: `_drain_orphan` posts nothing)
            self._drain_orphan(call.conn, call.msg_id, reply.result())
        call.fail(DirectError("call ended"))
        pending = [r for r in call.requests if not r.done()]
        for r in call.requests:
            if r.done() and not r.cancelled():
                r.exception()  # (retrieved)
        if pending:
            self._spawn(self._drain(call.conn, pending))

    async def _drain(self, conn: Connection, pending: list[asyncio.Future]) -> None:
        _, still = await asyncio.wait(pending, timeout=self.drain_timeout_s)
        for r in pending:
            if r.done() and not r.cancelled():
                r.exception()
        if still and not conn.closed:
            self.drops += 1
            log.info("gcache direct: UCX requests of a failed call did not drain; dropping the connection",
                     extra={"peer": conn.peer, "requests": len(still)})
            await conn.drop(PeerDisconnected(f"UCX requests to {conn.peer} did not drain"))

    def _on_message(self, conn: Connection, msg_id: int, body: bytes) -> None:
        call = self._calls.get((id(conn), msg_id))
        try:
            msg = decode(body)
        except DirectError as exc:
            if call is not None:
                call.fail(exc)
            return
        if call is None:
            self._drain_orphan(conn, msg_id, msg)
            return
        if "error" in msg:
            call.fail(DirectError(f"node {conn.peer}: {msg['error']}"))
        elif not call.reply.done():
            call.reply.set_result(msg)
        else:  # the caller's wait ended (its deadline cancelled the reply future) before this came: its values
            self._drain_orphan(conn, msg_id, msg)  # are on their way all the same (a put's reply: nothing)

    def _drain_orphan(self, conn: Connection, msg_id: int, msg: dict[str, Any]) -> None:
        """A get's reply after the call gave up: receive its values into scratch memory, so the node's sends
        complete (they would stay pending otherwise)."""
        try:
            sizes = int_list(msg, "sizes")
        except DirectError:
            return  # a put's reply: nothing is in flight towards us
        index, pending = 0, []
        try:
            link = tagged_link(conn)
            for size in sizes:
                for n in wire.chunk_sizes(max(size, 0), self.chunk_bytes):
                    pending.append(link.post_recv(message_tag(link.nonce, msg_id, index), scratch(n, self._scratch)))
                    index += 1
        except TransferError:
            return
        if pending:
            self._spawn(self._drain(conn, pending))

    def _on_drop(self, conn: Connection, err: TransferError) -> None:
        for call in list(self._calls.values()):
            if call.conn is conn:
                call.fail(err)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.001, deadline - asyncio.get_running_loop().time())
