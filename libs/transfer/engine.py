"""The transfer engine: listener, handshake, the connection cache, and the public API on top of them.

A receiver (decode) calls ``start()``, publishes ``address`` and registers each incoming
request with ``expect()``. A sender (prefill) calls ``begin_send(address, ...)`` and then
``send_layer()`` per layer and ``finish()``. Control connections are cached per peer address.
What differs between backends (how payload bytes move) is the engine's ``DataPlane``
(``backends/``); the frames, the connection and the registry are shared.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .api import KVTransferEngine
from .backends.base import DataPlane
from .backends.tcp import TcpDataPlane
from .backends.ucx import UcxDataPlane
from .buffers import Payload
from .config import TransferBackend, TransferConfig, select_backend
from .connection import Connection, ConnectionSide, read_frame
from .errors import PeerDisconnected, TransferError, TransferTimeout
from .frames import Frame, FrameError, Header, Hello, HelloAck, encode_frame
from .protocol import PROTOCOL_VERSION, LayerSpec, TransferHeader, parse_address
from .registry import TransferRegistry
from .transfers import Destinations, IncomingTransfer, OutgoingTransfer, TransferState, TransferStats

log = logging.getLogger("windserve.transfer")


class BaseTransferEngine(KVTransferEngine):
    """The shared engine; a subclass names its data plane (``plane_type``)."""

    plane_type: type[DataPlane]

    def __init__(self, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        self.engine_id = uuid.uuid4().hex[:12]
        self._plane = self.plane_type(self.config)
        self._registry = TransferRegistry(self.config)
        self._server: asyncio.Server | None = None
        self._connections: dict[str, Connection] = {}  # dialled, by peer address
        self._dialing: dict[str, asyncio.Future[Connection]] = {}
        self._accepted: set[Connection] = set()

    @property
    def backend(self) -> TransferBackend:
        return self.plane_type.backend

    @property
    def address(self) -> str:
        return self._registry.label

    @property
    def bytes_sent(self) -> int:
        return self._registry.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._registry.bytes_received

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        await self._plane.start()
        self._server = await asyncio.start_server(self._on_accept, host, port)
        bound = self._server.sockets[0].getsockname()
        self._registry.label = f"{self.backend.value}://{host}:{bound[1]}"
        return self.address

    async def close(self) -> None:
        err = TransferError(f"engine {self.address} closed")
        if self._server is not None:
            self._server.close()
        for conn in [*self._connections.values(), *self._accepted]:
            await conn.drop(err)
        await self._registry.close(err)
        await self._plane.stop()
        self._server = None

    async def __aenter__(self) -> BaseTransferEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- receiver API ------------------------------------------------------------------------
    def expect(self, request_id: str, destinations: Destinations) -> IncomingTransfer:
        self._require_started()
        return self._registry.expect(request_id, destinations)

    async def cancel(self, request_id: str, reason: str = "cancelled by receiver") -> bool:
        tr = self._registry.incoming(request_id)
        if tr is None:
            return False
        await tr.cancel(reason)
        return True

    # -- sender API ------------------------------------------------------------------------
    async def begin_send(self, address: str, request_id: str, layers: Sequence[LayerSpec]) -> OutgoingTransfer:
        if self._registry.outgoing(request_id) is not None:
            raise ValueError(f"request {request_id!r} is already being sent from {self.address}")
        header = TransferHeader(request_id, tuple(layers))
        conn = await self.connect(address)
        seq = conn.next_seq()
        tx = OutgoingTransfer(header, conn, seq, layer_timeout_s=self.config.layer_timeout_s,
                              drain_timeout_s=self.config.drain_timeout_s)
        conn.outgoing[seq] = tx
        self._registry.add_outgoing(tx)
        try:
            await conn.send_frame(Header(seq, header))
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
                   payloads: Sequence[Payload]) -> TransferStats:
        tx = await self.begin_send(address, request_id, layers)
        try:
            await tx.send_layers(payloads)  # (all layers in flight at once: no round trip per layer)
            stats = await tx.finish()
        except BaseException:
            await tx.abort("sender failed")
            raise
        return stats

    async def abort(self, request_id: str, reason: str = "aborted by sender") -> bool:
        tx = self._registry.outgoing(request_id)
        if tx is None:
            return False
        await tx.abort(reason)
        return True

    # -- messages (outside transfers: the direct path) -----------------------------------------
    def set_message_handler(self, handler: Callable[[Connection, int, bytes], None] | None) -> None:
        """Call ``handler(connection, msg_id, body)`` (on this loop, from the connection's reader) for every
        MESSAGE frame on any of this engine's connections, dialled or accepted; reply with
        ``connection.send_message``. It must not block: spawn what takes time."""
        self._registry.message_handler = handler

    def add_drop_listener(self, listener: Callable[[Connection, TransferError], None]) -> None:
        """Call ``listener(connection, error)`` when a connection drops (peer gone, protocol error, close): after
        its link closed, so nothing posted on it can still land."""
        self._registry.drop_listeners.append(listener)

    async def connect(self, address: str) -> Connection:
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

    # -- handshake ---------------------------------------------------------------------------
    async def _dial(self, address: str) -> Connection:
        scheme, host, port = parse_address(address)
        if scheme != self.backend.value:
            raise TransferError(f"{self.backend.value} engine cannot reach {address!r} (scheme {scheme})")
        timeout = self.config.connect_timeout_s
        nonce = int.from_bytes(os.urandom(8), "little")
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port)
            writer.write(encode_frame(Hello(PROTOCOL_VERSION, self.backend.value, self.engine_id, nonce,
                                            self._plane.local_address())))
            async with asyncio.timeout(timeout):
                reply = await read_frame(reader, self.config.max_control_bytes)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            raise PeerDisconnected(f"cannot connect to transfer engine at {address}: {exc!r}") from exc
        except FrameError as exc:
            writer.close()
            raise TransferError(f"handshake with {address} failed: {exc}") from exc
        if not isinstance(reply, HelloAck) or reply.error:
            writer.close()
            problem = reply.error if isinstance(reply, HelloAck) else f"got {reply.TYPE.name}"
            raise TransferError(f"handshake with {address} failed: {problem}")
        link = await self._plane.open_link(reader, writer, nonce, reply.data)
        conn = Connection(self._registry, ConnectionSide.SENDER, address, reader, writer, link, self._forget)
        conn.start()
        self._connections[address] = conn
        return conn

    async def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "{}:{}".format(*writer.get_extra_info("peername")[:2])
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                hello = await read_frame(reader, self.config.max_control_bytes)
            error = self._check_hello(hello)
            if error or not isinstance(hello, Hello):
                writer.write(encode_frame(HelloAck(error=error)))
                writer.close()
                return
            link = await self._plane.open_link(reader, writer, hello.nonce, hello.data)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, FrameError, TransferError) as exc:
            log.warning("transfer handshake from %s failed: %r", peer, exc)
            writer.close()
            return
        writer.write(encode_frame(HelloAck(engine=self.engine_id, data=self._plane.local_address())))
        conn = Connection(self._registry, ConnectionSide.RECEIVER, f"{hello.engine}@{peer}", reader, writer, link,
                          self._forget)
        self._accepted.add(conn)
        conn.start()

    def _check_hello(self, hello: Frame) -> str:
        if not isinstance(hello, Hello):
            return f"expected HELLO, got {hello.TYPE.name}"
        if hello.version != PROTOCOL_VERSION:
            return f"protocol version {hello.version} != {PROTOCOL_VERSION}"
        if hello.backend != self.backend.value:
            return f"backend {hello.backend} != {self.backend.value} at {self.address}"
        return ""

    def _forget(self, conn: Connection) -> None:
        if self._connections.get(conn.peer) is conn:
            del self._connections[conn.peer]
        self._accepted.discard(conn)

    def _require_started(self) -> None:
        if self._server is None:
            raise RuntimeError("transfer engine not started: call `await engine.start()` first")


class TcpTransferEngine(BaseTransferEngine):
    """Plain-TCP fallback: payloads inline on the control stream."""

    plane_type = TcpDataPlane


class UcxTransferEngine(BaseTransferEngine):
    """UCX engine on ``ucxx``: payloads are tagged messages between the engines' UCX workers."""

    plane_type = UcxDataPlane

    @property
    def ucx_context(self) -> Any:
        """This engine's ``ucxx`` context (benchmarks drive raw ucxx on the very same worker)."""
        assert isinstance(self._plane, UcxDataPlane)
        return self._plane.context


def create_engine(config: TransferConfig | None = None, backend: TransferBackend | None = None) -> KVTransferEngine:
    """The engine for ``backend`` (default: ``WINDSERVE_TRANSFER`` / whether ucxx is installed)."""
    chosen = backend or select_backend()
    return UcxTransferEngine(config) if chosen is TransferBackend.UCX else TcpTransferEngine(config)


def advertised_address(bound: str, advertise_host: str = "") -> str:
    """The transfer address peers dial: the bound one, with `advertise_host` in it when set, or this host's IP
    when binding all interfaces (under compose every replica has the same service name but its own IP)."""
    scheme, host, port = parse_address(bound)
    if advertise_host:
        host = advertise_host
    elif host in ("0.0.0.0", "::"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{scheme}://{host}:{port}"
