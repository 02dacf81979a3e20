"""One control connection between two engines: its reader loop and the dispatch of typed frames.

A connection has a side: the engine that dialled is the SENDER (it sends HEADER / LAYER / END /
ABORT), the engine that accepted is the RECEIVER (it answers ACCEPT / REJECT / DONE / CANCEL).
Transfers on it are multiplexed by ``seq``. The connection sees its engine only through the
``TransferRegistry`` and an ``on_close`` callback, so this module imports no engine code.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable

from .backends.base import Link
from .buffers import Payload, gather
from .errors import PeerDisconnected, TransferAborted, TransferError, TransferRejected, TransferTimeout
from .frames import (
    FRAME_PREFIX,
    Abort,
    Accept,
    Cancel,
    Done,
    End,
    Frame,
    FrameError,
    FrameType,
    Header,
    Layer,
    Message,
    Reject,
    decode_frame,
    decode_prefix,
    encode_frame,
)
from .registry import TransferRegistry
from .transfers import IncomingTransfer, OutgoingTransfer, TransferState


class ConnectionSide(enum.Enum):
    SENDER = "sender"  # dialled out: sends HEADER/LAYER/END/ABORT
    RECEIVER = "receiver"  # accepted: answers ACCEPT/REJECT/DONE/CANCEL


async def read_frame(reader: asyncio.StreamReader, max_body: int) -> Frame:
    """The next frame on the stream (IncompleteReadError at EOF, FrameError when malformed)."""
    ftype, length = decode_prefix(await reader.readexactly(FRAME_PREFIX.size), max_body)
    return decode_frame(ftype, await reader.readexactly(length))


class Connection:
    """One control connection and its data link; multiplexes transfers by sequence number."""

    def __init__(self, registry: TransferRegistry, side: ConnectionSide, peer: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, link: Link, on_close: Callable[[Connection], None]) -> None:
        self.registry = registry
        self.config = registry.config
        self.side = side
        self.peer = peer
        self.reader = reader
        self.writer = writer
        self.link = link
        self.closed = False
        self.outgoing: dict[int, OutgoingTransfer] = {}
        self.incoming: dict[int, IncomingTransfer] = {}
        self._on_close = on_close
        self._next_seq = 0
        self.reader_task: asyncio.Task | None = None

    def next_seq(self) -> int:
        self._next_seq += 1
        return self._next_seq

    def start(self) -> None:
        # Our own task (not asyncio's handler task) so drop()/close() can cancel it quietly.
        self.reader_task = self.registry.tasks.spawn(self.run())

    # -- writing (the SendChannel of outgoing transfers) ------------------------------------
    async def send_frame(self, frame: Frame) -> None:
        if self.closed:
            raise PeerDisconnected(f"connection to {self.peer} is closed")
        self.writer.write(encode_frame(frame))
        try:
            async with asyncio.timeout(self.config.layer_timeout_s):
                await self.writer.drain()
        except (ConnectionError, TimeoutError) as exc:
            err = PeerDisconnected(f"control connection to {self.peer} broke: {exc!r}")
            await self.drop(err)
            raise err from exc

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

    def post_message(self, msg_id: int, body: bytes) -> None:
        """Write a MESSAGE frame now, without waiting for the stream to drain (no event-loop hop: the direct
        path's requests and replies are small). PeerDisconnected when the connection is closed."""
        if self.closed or self.writer.is_closing():
            raise PeerDisconnected(f"connection to {self.peer} is closed")
        self.writer.write(encode_frame(Message(msg_id, body)))

    async def send_message(self, msg_id: int, body: bytes) -> None:
        """A MESSAGE frame to the peer's message handler (either side may send; bounded like every frame)."""
        await self.send_frame(Message(msg_id, body))

    async def send_end(self, seq: int) -> None:
        await self.send_frame(End(seq))

    async def send_abort(self, seq: int, reason: str) -> None:
        with contextlib.suppress(TransferError):  # a dead peer already failed its side
            await self.send_frame(Abort(seq, reason))

    def forget_outgoing(self, tx: OutgoingTransfer) -> None:
        self.outgoing.pop(tx.seq, None)
        self.registry.outgoing_finished(tx)

    # -- reading -----------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while True:
                frame = await self._next_frame()
                if frame is not None:
                    await self._dispatch(frame)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            await self.drop(PeerDisconnected(f"peer {self.peer} disconnected ({type(exc).__name__})"))
        except FrameError as exc:
            await self.drop(TransferError(f"protocol error from {self.peer}: {exc}"))
        except asyncio.CancelledError:
            await self.drop(TransferError(f"engine {self.registry.label} closed"))
            raise

    async def _next_frame(self) -> Frame | None:
        try:
            return await read_frame(self.reader, self.config.max_control_bytes)
        except FrameError as exc:
            # A HEADER we cannot parse fails that one transfer; any other malformed frame the connection.
            if exc.ftype is not FrameType.HEADER or exc.seq is None or self.side is not ConnectionSide.RECEIVER:
                raise
            await self._reply(Reject(exc.seq, f"malformed header: {exc}"))
            return None

    async def _dispatch(self, frame: Frame) -> None:
        if isinstance(frame, Message):
            self.registry.on_message(self, frame.msg_id, frame.body)
        elif isinstance(frame, Layer):
            await self._on_layer(frame)
        elif self.side is ConnectionSide.RECEIVER:
            self._on_receiver_frame(frame)
        else:
            self._on_sender_frame(frame)

    def _on_sender_frame(self, frame: Frame) -> None:
        if not isinstance(frame, Accept | Reject | Done | Cancel):
            raise FrameError(f"sender got unexpected {frame.TYPE.name} frame")
        tx = self.outgoing.get(frame.seq)
        if tx is None:
            return  # the transfer already ended here (aborted / timed out)
        match frame:
            case Accept():
                if not tx.accept_fut.done():
                    tx.accept_fut.set_result(None)
            case Reject(reason=reason):
                tx.fail(TransferRejected(f"receiver {self.peer} rejected request {tx.request_id}: {reason}"))
            case Done(nbytes=nbytes):
                if not tx.done_fut.done():
                    tx.done_fut.set_result(nbytes)
            case Cancel(reason=reason):
                tx.fail(TransferAborted(f"receiver {self.peer} cancelled request {tx.request_id}: {reason}"))

    def _on_receiver_frame(self, frame: Frame) -> None:
        match frame:
            case Header():
                self.registry.tasks.spawn(self._on_header(frame))
            case End(seq=seq):
                tr = self.incoming.get(seq)
                if tr is not None:
                    tr.end_seen = True
                    self._maybe_complete(tr)
            case Abort(seq=seq, reason=reason):
                tr = self.incoming.get(seq)
                if tr is not None:
                    err = TransferAborted(f"sender {self.peer} aborted request {tr.request_id}: {reason}")
                    self.registry.tasks.spawn(self.finish_failed(tr, err, notify=False))
            case _:
                raise FrameError(f"receiver got unexpected {frame.TYPE.name} frame")

    async def _on_header(self, frame: Header) -> None:
        header, seq = frame.header, frame.seq
        tr = await self.registry.claim(header.request_id)
        if tr is None:
            await self._reply(Reject(seq, f"no transfer expected for request {header.request_id!r} at "
                                          f"{self.registry.label}"))
            return
        try:
            tr.bind(header, peer=self.peer, seq=seq, canceller=self._cancel)
        except Exception as exc:  # the caller's allocator / shapes: reject, never hang
            tr.fail(TransferRejected(f"request {header.request_id}: {exc}"))
            self.registry.incoming_finished(tr)
            await self._reply(Reject(seq, str(exc)))
            return
        self.incoming[seq] = tr
        await self._reply(Accept(seq))

    async def _reply(self, frame: Frame) -> None:
        with contextlib.suppress(TransferError):
            await self.send_frame(frame)

    async def _on_layer(self, frame: Layer) -> None:
        seq, position, nbytes = frame.seq, frame.position, frame.nbytes
        tr = self.incoming.get(seq)
        problem = self._layer_problem(tr, position, nbytes)
        if problem and tr is not None:
            self.registry.tasks.spawn(self.finish_failed(tr, TransferError(problem), notify=True))
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
            self.registry.tasks.spawn(self.finish_failed(tr, err, notify=True))
            return
        tr.mark_landed(position)
        self._maybe_complete(tr)

    def _maybe_complete(self, tr: IncomingTransfer) -> None:
        if tr.state is not TransferState.ACTIVE:
            return
        if tr.end_seen and tr.header is not None and tr.announced < len(tr.header.layers):
            err = TransferError(f"request {tr.request_id}: sender ended after {tr.announced} of "
                                f"{len(tr.header.layers)} layers")
            self.registry.tasks.spawn(self.finish_failed(tr, err, notify=True))
            return
        if tr.all_landed:
            stats = tr.complete()
            self.incoming.pop(tr.seq, None)
            self.registry.incoming_finished(tr)
            self.registry.tasks.spawn(self._reply(Done(tr.seq, stats.nbytes)))

    async def _cancel(self, tr: IncomingTransfer, err: TransferError) -> None:
        await self.finish_failed(tr, err, notify=True)

    async def finish_failed(self, tr: IncomingTransfer, err: TransferError, *, notify: bool) -> None:
        """Fail a receiver transfer only once no payload can still land in its buffers."""
        if tr.state.terminal:
            return
        self.incoming.pop(tr.seq, None)  # later LAYER frames for it are drained and dropped
        if notify:
            await self._reply(Cancel(tr.seq, str(err)))
        if tr.pending:
            _, still = await asyncio.wait(set(tr.pending), timeout=self.config.drain_timeout_s)
            if still:  # only closing the endpoint cancels posted receives
                await self.drop(PeerDisconnected(f"in-flight payloads from {self.peer} did not drain"))
        tr.fail(err)
        self.registry.incoming_finished(tr)

    async def drop(self, err: TransferError) -> None:
        """Close the connection; every transfer on it fails with ``err`` (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._on_close(self)
        await self.link.close()  # cancels UCX requests before buffers are declared free
        self.writer.close()
        for tx in list(self.outgoing.values()):
            tx.fail(err)
        for tr in list(self.incoming.values()):
            tr.fail(err)
            self.registry.incoming_finished(tr)
        self.incoming.clear()
        self.registry.dropped(self, err)  # (after the link closed: no posted receive can land any more)
        if self.reader_task is not None and self.reader_task is not asyncio.current_task():
            self.reader_task.cancel()
