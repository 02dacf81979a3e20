"""Transfer engines: control connections, the expected-transfer registry, UCX / TCP data planes.

A receiver (decode) calls ``start()``, publishes ``address`` and registers each incoming
request with ``expect()``. A sender (prefill) calls ``begin_send(address, ...)`` and then
``send_layer()`` per layer and ``finish()``. Endpoints are cached per peer address.
Every wait is bounded by ``TransferConfig``; every failure surfaces as a ``TransferError``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

from .buffers import Payload, gather
from .config import Backend, TransferConfig, select_backend
from .errors import PeerDisconnected, TransferAborted, TransferError, TransferRejected, TransferTimeout
from .links import StreamLink, UcxLink
from .protocol import (
    FRAME_PREFIX,
    PROTOCOL_VERSION,
    FrameType,
    LayerSpec,
    ProtocolError,
    TransferHeader,
    decode_control,
    decode_layer,
    decode_prefix,
    encode_control,
)
from .transfers import Destinations, IncomingTransfer, OutgoingTransfer, TransferState

log = logging.getLogger("windserve.transfer")


class Role(enum.Enum):
    SENDER = "sender"  # dialled out: sends HEADER/LAYER/END/ABORT
    RECEIVER = "receiver"  # accepted: answers ACCEPT/REJECT/DONE/CANCEL


def parse_address(address: str) -> tuple[str, str, int]:
    """'ucx://host:port' -> ('ucx', host, port), with an error naming the bad address."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or not colon or not host or not port.isdigit():
        raise ValueError(f"transfer address must look like 'ucx://host:port' or 'tcp://host:port', got {address!r}")
    return scheme, host, int(port)


async def _read_frame(reader: asyncio.StreamReader, max_body: int) -> tuple[FrameType, bytes]:
    ftype, length = decode_prefix(await reader.readexactly(FRAME_PREFIX.size), max_body)
    return ftype, await reader.readexactly(length)


class _Connection:
    """One control connection and its data link; multiplexes transfers by sequence number."""

    def __init__(self, engine: _EngineBase, role: Role, peer: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, link: Any) -> None:
        self.engine = engine
        self.role = role
        self.peer = peer
        self.reader = reader
        self.writer = writer
        self.link = link
        self.closed = False
        self.outgoing: dict[int, OutgoingTransfer] = {}
        self.incoming: dict[int, IncomingTransfer] = {}
        self._next_seq = 0
        self.reader_task: asyncio.Task | None = None

    def next_seq(self) -> int:
        self._next_seq += 1
        return self._next_seq

    # -- writing ---------------------------------------------------------------------
    async def send_frame(self, frame: bytes) -> None:
        if self.closed:
            raise PeerDisconnected(f"connection to {self.peer} is closed")
        self.writer.write(frame)
        try:
            async with asyncio.timeout(self.engine.config.layer_timeout_s):
                await self.writer.drain()
        except (ConnectionError, TimeoutError) as exc:
            err = PeerDisconnected(f"control connection to {self.peer} broke: {exc!r}")
            await self.drop(err)
            raise err from exc

    async def send_control(self, ftype: FrameType, body: dict[str, Any]) -> None:
        await self.send_frame(encode_control(ftype, body))

    async def send_payload(self, seq: int, position: int, payload: Payload) -> None:
        if self.closed:
            raise PeerDisconnected(f"connection to {self.peer} is closed")
        try:
            await self.link.send(seq, position, gather(payload))
        except TransferTimeout as exc:
            await self.drop(exc)  # closing the link cancels the stuck request
            raise
        except TransferError as exc:
            await self.drop(PeerDisconnected(f"payload to {self.peer} failed: {exc}"))
            raise

    async def send_end(self, seq: int) -> None:
        await self.send_control(FrameType.END, {"seq": seq})

    async def send_abort(self, seq: int, reason: str) -> None:
        with contextlib.suppress(TransferError):  # a dead peer already failed its side
            await self.send_control(FrameType.ABORT, {"seq": seq, "reason": reason})

    def forget_outgoing(self, tx: OutgoingTransfer) -> None:
        self.outgoing.pop(tx.seq, None)
        self.engine._outgoing.pop(tx.request_id, None)

    # -- reading ---------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while True:
                ftype, body = await _read_frame(self.reader, self.engine.config.max_control_bytes)
                await self._dispatch(ftype, body)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            await self.drop(PeerDisconnected(f"peer {self.peer} disconnected ({type(exc).__name__})"))
        except ProtocolError as exc:
            await self.drop(TransferError(f"protocol error from {self.peer}: {exc}"))
        except asyncio.CancelledError:
            await self.drop(TransferError(f"engine {self.engine.address} closed"))
            raise

    async def _dispatch(self, ftype: FrameType, body: bytes) -> None:
        if ftype is FrameType.LAYER:
            await self._on_layer(*decode_layer(body))
            return
        msg = decode_control(ftype, body)
        seq = int(msg.get("seq", -1))
        if self.role is Role.RECEIVER:
            self._dispatch_receiver(ftype, seq, msg)
        else:
            self._dispatch_sender(ftype, seq, msg)

    def _dispatch_sender(self, ftype: FrameType, seq: int, msg: dict[str, Any]) -> None:
        tx = self.outgoing.get(seq)
        if tx is None:
            return  # the transfer already ended here (aborted / timed out)
        reason = str(msg.get("reason", ""))
        if ftype is FrameType.ACCEPT:
            if not tx.accept_fut.done():
                tx.accept_fut.set_result(None)
        elif ftype is FrameType.REJECT:
            tx.fail(TransferRejected(f"receiver {self.peer} rejected request {tx.request_id}: {reason}"))
        elif ftype is FrameType.DONE:
            if not tx.done_fut.done():
                tx.done_fut.set_result(int(msg.get("bytes", 0)))
        elif ftype is FrameType.CANCEL:
            tx.fail(TransferAborted(f"receiver {self.peer} cancelled request {tx.request_id}: {reason}"))
        else:
            raise ProtocolError(f"sender got unexpected {ftype.name} frame")

    def _dispatch_receiver(self, ftype: FrameType, seq: int, msg: dict[str, Any]) -> None:
        if ftype is FrameType.HEADER:
            self.engine._spawn(self._on_header(seq, msg))
        elif ftype is FrameType.END:
            tr = self.incoming.get(seq)
            if tr is not None:
                tr.end_seen = True
                self._maybe_complete(tr)
        elif ftype is FrameType.ABORT:
            tr = self.incoming.get(seq)
            if tr is not None:
                err = TransferAborted(f"sender {self.peer} aborted request {tr.request_id}: {msg.get('reason')}")
                self.engine._spawn(self.finish_failed(tr, err, notify=False))
        else:
            raise ProtocolError(f"receiver got unexpected {ftype.name} frame")

    async def _on_header(self, seq: int, msg: dict[str, Any]) -> None:
        try:
            header = TransferHeader.from_wire(msg)
        except (KeyError, ValueError, TypeError) as exc:
            await self._reply(FrameType.REJECT, seq, f"malformed header: {exc}")
            return
        tr = await self.engine._claim(header.request_id)
        if tr is None:
            await self._reply(FrameType.REJECT, seq, f"no transfer expected for request "
                              f"{header.request_id!r} at {self.engine.address}")
            return
        try:
            tr.bind(header, self, seq)
        except Exception as exc:  # the caller's allocator / shapes: reject, never hang
            tr.fail(TransferRejected(f"request {header.request_id}: {exc}"))
            self.engine._finished(tr)
            await self._reply(FrameType.REJECT, seq, str(exc))
            return
        self.incoming[seq] = tr
        await self._reply(FrameType.ACCEPT, seq, "")

    async def _reply(self, ftype: FrameType, seq: int, reason: str) -> None:
        with contextlib.suppress(TransferError):
            await self.send_control(ftype, {"seq": seq, "reason": reason})

    async def _on_layer(self, seq: int, position: int, nbytes: int) -> None:
        tr = self.incoming.get(seq)
        problem = self._layer_problem(tr, position, nbytes)
        if problem and tr is not None:
            self.engine._spawn(self.finish_failed(tr, TransferError(problem), notify=True))
        if problem or tr is None:
            await self.link.receive(seq, position, nbytes, None)  # consume and drop
            return
        tr.announced += 1
        fut = await self.link.receive(seq, position, nbytes, tr.landing(position))
        tr.pending.add(fut)
        fut.add_done_callback(lambda f: self._landed(tr, position, f))

    @staticmethod
    def _layer_problem(tr: IncomingTransfer | None, position: int, nbytes: int) -> str:
        if tr is None or tr.state is not TransferState.ACTIVE or tr.header is None:
            return ""
        if position != tr.announced:
            return f"request {tr.request_id}: layer {position} arrived, expected {tr.announced}"
        if nbytes != tr.header.layers[position].nbytes:
            return (f"request {tr.request_id}: layer {position} has {nbytes} bytes, "
                    f"header says {tr.header.layers[position].nbytes}")
        return ""

    def _landed(self, tr: IncomingTransfer, position: int, fut: asyncio.Future) -> None:
        tr.pending.discard(fut)
        if tr.state is not TransferState.ACTIVE:
            return
        if fut.cancelled() or fut.exception() is not None:
            err = TransferError(f"request {tr.request_id}: receiving layer {position} from {self.peer} "
                                f"failed: {fut.exception() if not fut.cancelled() else 'cancelled'}")
            self.engine._spawn(self.finish_failed(tr, err, notify=True))
            return
        tr.mark_landed(position)
        self._maybe_complete(tr)

    def _maybe_complete(self, tr: IncomingTransfer) -> None:
        if tr.state is not TransferState.ACTIVE:
            return
        if tr.end_seen and tr.header is not None and tr.announced < len(tr.header.layers):
            err = TransferError(f"request {tr.request_id}: sender ended after {tr.announced} of "
                                f"{len(tr.header.layers)} layers")
            self.engine._spawn(self.finish_failed(tr, err, notify=True))
            return
        if tr.all_landed:
            stats = tr.complete()
            self.incoming.pop(tr.seq, None)
            self.engine._finished(tr)
            self.engine._spawn(self._reply_done(tr.seq, stats.nbytes))

    async def _reply_done(self, seq: int, nbytes: int) -> None:
        with contextlib.suppress(TransferError):
            await self.send_control(FrameType.DONE, {"seq": seq, "bytes": nbytes})

    async def finish_failed(self, tr: IncomingTransfer, err: TransferError, *, notify: bool) -> None:
        """Fail a receiver transfer only once no payload can still land in its buffers."""
        if tr.state.terminal:
            return
        self.incoming.pop(tr.seq, None)  # later LAYER frames for it are drained and dropped
        if notify:
            await self._reply(FrameType.CANCEL, tr.seq, str(err))
        if tr.pending:
            _, still = await asyncio.wait(set(tr.pending), timeout=self.engine.config.drain_timeout_s)
            if still:  # only closing the endpoint cancels posted receives
                await self.drop(PeerDisconnected(f"in-flight payloads from {self.peer} did not drain"))
        tr.fail(err)
        self.engine._finished(tr)

    async def drop(self, err: TransferError) -> None:
        """Close the connection; every transfer on it fails with ``err`` (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.engine._forget_connection(self)
        await self.link.close()  # cancels UCX requests before buffers are declared free
        self.writer.close()
        for tx in list(self.outgoing.values()):
            tx.fail(err)
        for tr in list(self.incoming.values()):
            tr.fail(err)
            self.engine._finished(tr)
        self.incoming.clear()
        if self.reader_task is not None and self.reader_task is not asyncio.current_task():
            self.reader_task.cancel()


class _EngineBase:
    """Shared engine logic; subclasses supply the data link for each connection."""

    backend: Backend

    def __init__(self, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        self.engine_id = uuid.uuid4().hex[:12]
        self.address = ""
        self._server: asyncio.Server | None = None
        self._connections: dict[str, _Connection] = {}
        self._dialing: dict[str, asyncio.Future] = {}
        self._accepted: set[_Connection] = set()
        self._expected: dict[str, IncomingTransfer] = {}
        self._active_in: dict[str, IncomingTransfer] = {}
        self._outgoing: dict[str, OutgoingTransfer] = {}
        self._registered: asyncio.Condition | None = None
        self._tasks: set[asyncio.Task] = set()
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host`` (free port by default); returns ``address`` for the registry."""
        if self._server is not None:
            raise RuntimeError(f"engine {self.address} already started")
        self._registered = asyncio.Condition()
        await self._start_data_plane()
        self._server = await asyncio.start_server(self._on_accept, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = f"{self.backend.value}://{host}:{bound[1]}"
        return self.address

    async def close(self) -> None:
        """Fail everything in flight, close connections and the listener, release UCX."""
        err = TransferError(f"engine {self.address} closed")
        if self._server is not None:
            self._server.close()
        for conn in [*self._connections.values(), *self._accepted]:
            await conn.drop(err)
        for tr in [*self._expected.values(), *self._active_in.values()]:
            tr.fail(err)
        self._expected.clear()
        self._active_in.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._stop_data_plane()
        self._server = None

    async def __aenter__(self) -> _EngineBase:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- receiver API ----------------------------------------------------------------------
    def expect(self, request_id: str, destinations: Destinations) -> IncomingTransfer:
        """Register an incoming transfer; headers for unknown ids are rejected."""
        self._require_started()
        if request_id in self._expected or request_id in self._active_in:
            raise ValueError(f"request {request_id!r} is already expected on {self.address}")
        tr = IncomingTransfer(request_id, destinations, layer_timeout_s=self.config.layer_timeout_s,
                              canceller=self._cancel_incoming)
        self._expected[request_id] = tr
        loop = asyncio.get_running_loop()
        loop.call_later(self.config.header_timeout_s, self._expire, tr)
        self._spawn(self._notify_registered())
        return tr

    async def cancel(self, request_id: str, reason: str = "cancelled by receiver") -> bool:
        tr = self._expected.get(request_id) or self._active_in.get(request_id)
        if tr is None:
            return False
        await tr.cancel(reason)
        return True

    # -- sender API ----------------------------------------------------------------------
    async def begin_send(self, address: str, request_id: str, layers: Sequence[LayerSpec]) -> OutgoingTransfer:
        """Send the header and wait (bounded) for the receiver to accept it."""
        if request_id in self._outgoing:
            raise ValueError(f"request {request_id!r} is already being sent from {self.address}")
        header = TransferHeader(request_id, tuple(layers))
        conn = await self.connect(address)
        seq = conn.next_seq()
        tx = OutgoingTransfer(header, conn, seq, layer_timeout_s=self.config.layer_timeout_s,
                              drain_timeout_s=self.config.drain_timeout_s)
        conn.outgoing[seq] = tx
        self._outgoing[request_id] = tx
        try:
            await conn.send_control(FrameType.HEADER, header.to_wire(seq))
            async with asyncio.timeout(self.config.accept_timeout_s):
                await asyncio.shield(tx.accept_fut)
        except TimeoutError:
            await tx.abort("receiver did not answer the header")
            raise TransferTimeout(f"request {request_id}: receiver {address} did not accept within "
                                  f"{self.config.accept_timeout_s:.3g}s") from None
        except TransferError as exc:
            tx.fail(exc)
            raise
        tx.state = TransferState.ACTIVE
        return tx

    async def send(self, address: str, request_id: str, layers: Sequence[LayerSpec],
                   payloads: Sequence[Payload]) -> Any:
        """Convenience: begin_send + every layer + finish; aborts on any local error."""
        tx = await self.begin_send(address, request_id, layers)
        try:
            for payload in payloads:
                await tx.send_layer(payload)
            stats = await tx.finish()
        except BaseException:
            await tx.abort("sender failed")
            raise
        return stats

    async def abort(self, request_id: str, reason: str = "aborted by sender") -> bool:
        tx = self._outgoing.get(request_id)
        if tx is None:
            return False
        await tx.abort(reason)
        return True

    async def connect(self, address: str) -> _Connection:
        """The cached control connection to ``address``, dialled (bounded) on first use."""
        self._require_started()
        conn = self._connections.get(address)
        if conn is not None and not conn.closed:
            return conn
        pending = self._dialing.get(address)
        if pending is None:
            pending = asyncio.ensure_future(self._dial(address))
            self._dialing[address] = pending
            pending.add_done_callback(lambda _: self._dialing.pop(address, None))
        return await asyncio.shield(pending)

    # -- internals -----------------------------------------------------------------------
    async def _dial(self, address: str) -> _Connection:
        scheme, host, port = parse_address(address)
        if scheme != self.backend.value:
            raise TransferError(f"{self.backend.value} engine cannot reach {address!r} (scheme {scheme})")
        timeout = self.config.connect_timeout_s
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port)
            nonce = int.from_bytes(os.urandom(8), "little")
            writer.write(encode_control(FrameType.HELLO, {
                "version": PROTOCOL_VERSION, "backend": self.backend.value, "engine": self.engine_id,
                "nonce": nonce, "data": self._data_address()}))
            async with asyncio.timeout(timeout):
                ftype, body = await _read_frame(reader, self.config.max_control_bytes)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            raise PeerDisconnected(f"cannot connect to transfer engine at {address}: {exc!r}") from exc
        reply = decode_control(ftype, body)
        if ftype is not FrameType.HELLO_ACK or reply.get("error"):
            writer.close()
            raise TransferError(f"handshake with {address} failed: {reply.get('error', ftype.name)}")
        link = await self._open_link(reader, writer, nonce, reply.get("data"))
        conn = _Connection(self, Role.SENDER, address, reader, writer, link)
        conn.reader_task = self._spawn(conn.run())
        self._connections[address] = conn
        return conn

    async def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "{}:{}".format(*writer.get_extra_info("peername")[:2])
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                ftype, body = await _read_frame(reader, self.config.max_control_bytes)
            hello = decode_control(ftype, body)
            error = self._check_hello(ftype, hello)
            if error:
                writer.write(encode_control(FrameType.HELLO_ACK, {"error": error}))
                writer.close()
                return
            link = await self._open_link(reader, writer, int(hello["nonce"]), hello.get("data"))
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ProtocolError, TransferError) as exc:
            log.warning("transfer handshake from %s failed: %r", peer, exc)
            writer.close()
            return
        writer.write(encode_control(FrameType.HELLO_ACK, {"engine": self.engine_id, "data": self._data_address()}))
        conn = _Connection(self, Role.RECEIVER, f"{hello.get('engine')}@{peer}", reader, writer, link)
        self._accepted.add(conn)
        # Our own task (not asyncio's handler task) so drop()/close() can cancel it quietly.
        conn.reader_task = self._spawn(conn.run())

    def _check_hello(self, ftype: FrameType, hello: dict[str, Any]) -> str:
        if ftype is not FrameType.HELLO:
            return f"expected HELLO, got {ftype.name}"
        if hello.get("version") != PROTOCOL_VERSION:
            return f"protocol version {hello.get('version')} != {PROTOCOL_VERSION}"
        if hello.get("backend") != self.backend.value:
            return f"backend {hello.get('backend')} != {self.backend.value} at {self.address}"
        return ""

    def _forget_connection(self, conn: _Connection) -> None:
        if self._connections.get(conn.peer) is conn:
            del self._connections[conn.peer]
        self._accepted.discard(conn)

    async def _claim(self, request_id: str) -> IncomingTransfer | None:
        """Move an expected transfer to active, waiting up to the grace for a late expect()."""
        assert self._registered is not None
        async with self._registered:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.register_grace_s):
                    await self._registered.wait_for(lambda: request_id in self._expected)
        tr = self._expected.pop(request_id, None)
        if tr is not None:
            self._active_in[request_id] = tr
        return tr

    async def _notify_registered(self) -> None:
        assert self._registered is not None
        async with self._registered:
            self._registered.notify_all()

    def _finished(self, tr: IncomingTransfer) -> None:
        if self._active_in.get(tr.request_id) is tr:
            del self._active_in[tr.request_id]
            if tr.state is TransferState.COMPLETE:
                self.bytes_received += tr.bytes_received
        if self._expected.get(tr.request_id) is tr:
            del self._expected[tr.request_id]

    def _expire(self, tr: IncomingTransfer) -> None:
        if tr.state is TransferState.EXPECTED:
            tr.fail(TransferTimeout(f"request {tr.request_id}: no header within {self.config.header_timeout_s:.3g}s"))
            self._finished(tr)

    async def _cancel_incoming(self, tr: IncomingTransfer, err: TransferError) -> None:
        if tr.conn is None:  # header never came: nothing is in flight
            tr.fail(err)
            self._finished(tr)
            return
        await tr.conn.finish_failed(tr, err, notify=True)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _require_started(self) -> None:
        if self._server is None:
            raise RuntimeError("transfer engine not started: call `await engine.start()` first")

    # -- data plane hooks ----------------------------------------------------------------
    async def _start_data_plane(self) -> None:
        return None

    async def _stop_data_plane(self) -> None:
        return None

    def _data_address(self) -> str | None:
        return None

    async def _open_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nonce: int,
                         peer_data: str | None) -> Any:
        raise NotImplementedError


class TcpTransferEngine(_EngineBase):
    """Plain-TCP fallback: payloads inline on the control stream (asyncio streams)."""

    backend = Backend.TCP

    async def _open_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nonce: int,
                         peer_data: str | None) -> StreamLink:
        return StreamLink(writer, reader, self.config.layer_timeout_s)


class TransferEngine(_EngineBase):
    """UCX engine on ``ucxx``: payloads are tagged messages between the engines' UCX workers.

    Each engine owns its UCX context + worker (progress thread, Python-future notifier),
    created in ``start()`` inside the running event loop; UCX settings come from
    ``config.ucx_options`` and then the ``UCX_*`` environment (e.g. ``UCX_TLS=sm,self``).
    """

    backend = Backend.UCX

    def __init__(self, config: TransferConfig | None = None) -> None:
        super().__init__(config)
        self._ctx: Any = None
        self._progress: Any = None

    async def _start_data_plane(self) -> None:
        from ucxx._lib_async import ApplicationContext
        from ucxx._lib_async.application_context import ProgressTasks
        from ucxx._lib_async.continuous_ucx_progress import ThreadMode

        loop = asyncio.get_running_loop()
        previous = ProgressTasks.get(loop)
        self._ctx = ApplicationContext(dict(self.config.ucx_options), progress_mode="thread",
                                       enable_python_future=True)
        # ucxx keeps one progress task per event loop in a module-level dict, so a second
        # context on the same loop would never be progressed; each engine owns its thread.
        task = ProgressTasks.get(loop)
        if task is not previous and task is not None and task.worker is self._ctx.worker:
            self._progress = ProgressTasks.pop(loop)
            if previous is not None:
                ProgressTasks[loop] = previous
        else:
            self._progress = ThreadMode(self._ctx.worker, loop)

    async def _stop_data_plane(self) -> None:
        if self._ctx is None:
            return
        # Wake the notifier first: otherwise its 1 s wait blocks stop_notifier_thread().
        self._ctx.worker.stop_request_notifier_thread()
        self._ctx.stop_notifier_thread()
        self._ctx.worker.stop_progress_thread()
        self._ctx, self._progress = None, None

    def _data_address(self) -> str | None:
        return base64.b64encode(bytes(self._ctx.worker_address)).decode() if self._ctx else None

    async def _open_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nonce: int,
                         peer_data: str | None) -> UcxLink:
        import ucxx

        if not peer_data:
            raise TransferError("peer sent no UCX worker address")
        address = ucxx.get_ucx_address_from_buffer(base64.b64decode(peer_data))
        try:
            ep = await self._ctx.create_endpoint_from_worker_address(
                address, endpoint_error_handling=self.config.endpoint_error_handling())
        except Exception as exc:
            raise TransferError(f"UCX cannot reach the peer worker (UCX_TLS={self.config.ucx_tls()}): "
                                f"{exc!r}") from exc
        return UcxLink(ep, nonce, writer, self.config.layer_timeout_s)


def create_engine(config: TransferConfig | None = None, backend: Backend | None = None) -> _EngineBase:
    """The engine for ``backend`` (default: ``WINDSERVE_TRANSFER`` / whether ucxx is installed)."""
    chosen = backend or select_backend()
    return TransferEngine(config) if chosen is Backend.UCX else TcpTransferEngine(config)
