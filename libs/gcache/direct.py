"""The direct path, client side: puts and gets to a node without NATS or transfer headers.

Holds the MESSAGE codec and `DirectCalls`, the client side of one IO thread: MESSAGE frames on the engine's
control connection to the node, one tagged UCX message per value, each value hashed once per call.

Failure contract: a call fails (its keys become misses) when the connection drops, the node answers an
error or nonsense, or the caller's deadline passes. A failed call's UCX requests get `drain_timeout_s`,
then the connection is dropped, so UCX touches no buffer afterwards; unwanted replies are drained into
scratch memory; a put's sums are sent even when its caller gave up. Protocol: docs/gcache.md, "The direct
path".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
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
from .keys import value_checksum

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
    verdict: asyncio.Future[dict[str, Any]]  # a get's second message (`bad`), when its reply said `check`
    requests: list[asyncio.Future] = field(default_factory=list)  # UCX sends / receives posted for it

    def fail(self, exc: BaseException) -> None:
        for fut in (self.reply, self.verdict):
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # (retrieved: an answer nobody waits for is no news)


def checksums(values: Sequence[Buffer]) -> list[int]:
    """The values' checksums (run it in a thread: xxhash releases the GIL)."""
    return [value_checksum(v) for v in values]


class DirectCalls:
    """The direct path of one IO thread over its (UCX) transfer engine: `put` and `get` to a node's address.
    Registers the engine's message handler and a drop listener; one owner loop."""

    def __init__(self, engine: Any, allocate: Callable[[int], memoryview], message_bytes: int,
                 drain_timeout_s: float = 2.0) -> None:
        self.engine = engine
        self.allocate = allocate
        self.message_bytes = message_bytes
        self.drain_timeout_s = drain_timeout_s
        self._ids = itertools.count(1)
        self._calls: dict[tuple[int, int], _DirectCall] = {}
        self._scratch: list[np.ndarray] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.calls = 0  # direct calls made (tests, health)
        self.drops = 0  # connections dropped because a failed call's UCX requests did not drain
        self.checksum_failures = 0  # values the node found corrupt while sending them (misses)
        engine.set_message_handler(self._on_message)
        engine.add_drop_listener(self._on_drop)

    # ------------------------------------------------------------------ calls

    async def put(self, address: str, items: Sequence[tuple[str, Buffer]], deadline: float,
                  sums: Callable[[], Awaitable[list[int]]] | None = None) -> list[bool]:
        """Store `items` (key, value) on the node at `address`; per item, whether it stored it. The request and
        the values go at once; the values' checksums (`sums()`, default: hashed on a thread) follow them."""
        conn = await self._connect(address, deadline)
        call = self._open(conn)
        size = self.message_bytes
        try:
            conn.post_message(call.msg_id, encode({"op": "put", "chunk": size, "items": [
                [key, len(value)] for key, value in items]}))
            link, index = tagged_link(conn), 0
            for _, value in items:
                for view in wire.chunk_arrays(value, size):
                    call.requests.append(link.post_send(message_tag(link.nonce, call.msg_id, index), view))
                    index += 1
            self._spawn(self._send_sums(conn, call.msg_id, sums() if sums is not None
                                        else asyncio.to_thread(checksums, [value for _, value in items])))
            async with asyncio.timeout(self._left(deadline)):
                reply = await call.reply
            await _all_done(call.requests, self._left(deadline))  # (by now: the node took or drained every value)
            return bool_list(reply, "stored", len(items))
        finally:
            self._close(call)

    async def _send_sums(self, conn: Connection, msg_id: int, sums: Awaitable[list[int]]) -> None:
        """A put's checksums, posted once hashed, whether or not its caller still waits (the node commits
        nothing without them and would hold the slots until its put timeout)."""
        try:
            body = encode({"op": "sums", "sums": await sums})
        except Exception as exc:  # (hashing failed: the node aborts the put at its timeout)
            log.warning("gcache direct put: hashing failed", extra={"peer": conn.peer, "error": repr(exc)})
            return
        with contextlib.suppress(TransferError):  # (the node is gone: its put went with it)
            conn.post_message(msg_id, body)

    async def get(self, address: str, keys: Sequence[str], deadline: float) -> list[Buffer | None]:
        """The values of `keys` on the node at `address` (None: a miss there, or a value the node found corrupt
        while sending it: counted)."""
        conn = await self._connect(address, deadline)
        call = self._open(conn)
        try:
            conn.post_message(call.msg_id, encode({"op": "get", "chunk": self.message_bytes, "keys": list(keys)}))
            async with asyncio.timeout(self._left(deadline)):
                reply = await call.reply
            sizes = int_list(reply, "sizes", len(keys))
            buffers = self._post_receives(call, sizes)
            await _all_done(call.requests, self._left(deadline))
            bad: set[int] = set()
            if reply.get("check") is True:
                async with asyncio.timeout(self._left(deadline)):
                    bad = set(int_list(await call.verdict, "bad"))
            if bad:
                self.checksum_failures += len(bad)
                log.warning("gcache get: the node found values corrupt (misses)",
                            extra={"peer": conn.peer, "keys": [keys[i] for i in sorted(bad) if 0 <= i < len(keys)]})
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

    def _post_receives(self, call: _DirectCall, sizes: list[int]) -> dict[int, memoryview]:
        """A landing buffer per value (the IO thread's arena) and a receive posted per message, in value order."""
        link, index = tagged_link(call.conn), 0
        buffers: dict[int, memoryview] = {}
        for pos, size in enumerate(sizes):
            if size <= 0:
                continue
            buffers[pos] = buf = self.allocate(size)
            for view in wire.chunk_arrays(buf, self.message_bytes):
                call.requests.append(link.post_recv(message_tag(link.nonce, call.msg_id, index), view))
                index += 1
        return buffers

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
        call = _DirectCall(conn, next(self._ids), loop.create_future(), loop.create_future())
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
        elif "bad" in msg:
            if not call.verdict.done():
                call.verdict.set_result(msg)
        elif not call.reply.done():
            call.reply.set_result(msg)
        elif "sizes" in msg:  # the caller's wait ended (its deadline cancelled the reply future) before this
            self._drain_orphan(conn, msg_id, msg)  # came: its values are on their way all the same

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
                for n in wire.chunk_sizes(max(size, 0), self.message_bytes):
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
