"""Per-transfer state: the receiver's IncomingTransfer and the sender's OutgoingTransfer.

Both hold futures the caller awaits (always with a bound) and are driven by the engine's
control connection, which they see only through the narrow ``SendChannel`` / canceller seams
(so this module imports no connection code). Once a transfer reaches a terminal state it never
changes again.

An outgoing transfer has no idle timeout: between ``send_layer`` calls it may stay open for as
long as the sender computes (prefill streams each chunk's pages as the chunk finishes). Each
call's own wait is bounded (``layer_timeout_s``), and the receiver bounds its waits itself.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .buffers import Payload, check_payload, landing_buffer, payload_nbytes, scatter
from .errors import TransferAborted, TransferError, TransferTimeout
from .protocol import TransferHeader

# Fails an incoming transfer with an error: the registry's until a header binds the transfer to a
# connection (nothing in flight yet), then the connection's (which first drains in-flight payloads).
Canceller = Callable[["IncomingTransfer", TransferError], Awaitable[None]]


class SendChannel(Protocol):
    """What an outgoing transfer needs from its control connection."""

    peer: str

    async def send_payload(self, seq: int, position: int, payload: Payload) -> None: ...

    async def send_end(self, seq: int) -> None: ...

    async def send_abort(self, seq: int, reason: str) -> None: ...

    async def drop(self, err: TransferError) -> None: ...

    def forget_outgoing(self, tx: OutgoingTransfer) -> None:
        """The transfer ended (COMPLETE or FAILED); a COMPLETE one counts into the engine's bytes_sent."""


# Receiver destinations: one Payload per layer in header order, or a callback that
# allocates them from the header (so decode can take pages from its pools on arrival).
DestinationFactory = Callable[[TransferHeader], Sequence[Payload]]
Destinations = Sequence[Payload] | DestinationFactory


class TransferState(enum.Enum):
    EXPECTED = "expected"  # receiver: registered, header not yet arrived
    NEGOTIATING = "negotiating"  # sender: header sent, waiting for ACCEPT
    ACTIVE = "active"
    COMPLETE = "complete"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.COMPLETE, TransferState.FAILED)


@dataclass(frozen=True)
class TransferStats:
    request_id: str
    layers: int
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _quiet_future(loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """A future whose exception never triggers 'exception was never retrieved' noise."""
    fut = loop.create_future()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


def _settle(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


async def _bounded(fut: Awaitable, timeout: float, what: str) -> object:
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.shield(fut)
    except TimeoutError:
        raise TransferTimeout(f"{what} did not happen within {timeout:.3g}s") from None


class IncomingTransfer:
    """Receiver side of one request's KV transfer, created by ``engine.expect()``."""

    def __init__(self, request_id: str, destinations: Destinations, *, layer_timeout_s: float,
                 canceller: Canceller) -> None:
        loop = asyncio.get_running_loop()
        self.request_id = request_id
        self.state = TransferState.EXPECTED
        self.header: TransferHeader | None = None
        self.bytes_received = 0
        self.peer: str | None = None
        self._destinations = destinations
        self._dests: list[Payload] = []
        self._landing: dict[int, torch.Tensor] = {}
        self._layer_timeout_s = layer_timeout_s
        self._canceller = canceller
        self._header_fut = _quiet_future(loop)
        self._layer_futs: list[asyncio.Future] = []
        self._done_fut = _quiet_future(loop)
        self._started = time.perf_counter()
        # Engine-side bookkeeping (driven by the control connection).
        self.seq = -1
        self.announced = 0
        self.landed = 0
        self.end_seen = False
        self.pending: set[asyncio.Future] = set()

    # -- caller API -------------------------------------------------------------------
    async def wait_header(self, timeout: float | None = None) -> TransferHeader:
        return await self._await(self._header_fut, timeout, "header")  # type: ignore[return-value]

    async def layer(self, position: int, timeout: float | None = None) -> Payload:
        """The destination of layer ``position`` (header order) once its bytes have landed."""
        await self.wait_header(timeout)
        return await self._await(self._layer_futs[position], timeout, f"layer {position}")  # type: ignore

    async def layers(self, timeout: float | None = None) -> AsyncIterator[tuple[int, Payload]]:
        """Yield (position, destination) in header order as each layer lands."""
        header = await self.wait_header(timeout)
        for position in range(len(header.layers)):
            yield position, await self.layer(position, timeout)

    async def wait(self, timeout: float | None = None) -> TransferStats:
        """Until every layer landed; a timeout cancels the transfer (both sides free KV)."""
        return await self._await(self._done_fut, timeout, "completion")  # type: ignore[return-value]

    async def cancel(self, reason: str = "cancelled by receiver") -> None:
        if not self.state.terminal:
            await self._canceller(self, TransferAborted(f"request {self.request_id}: {reason}"))

    async def _await(self, fut: asyncio.Future, timeout: float | None, what: str) -> object:
        limit = self._layer_timeout_s if timeout is None else timeout
        try:
            return await _bounded(fut, limit, f"request {self.request_id}: {what}")
        except TransferTimeout as exc:
            await self._canceller(self, exc)
            raise

    # -- engine side --------------------------------------------------------------------
    def bind(self, header: TransferHeader, *, peer: str, seq: int, canceller: Canceller) -> None:
        """Attach the arriving header: allocate/validate destinations (ValueError = reject).

        From here on ``canceller`` (the connection's) cancels it: payloads may be in flight."""
        dests = self._destinations(header) if callable(self._destinations) else self._destinations
        dests = list(dests)
        if len(dests) != len(header.layers):
            raise ValueError(f"request {self.request_id}: {len(dests)} destinations for "
                             f"{len(header.layers)} layers")
        for spec, dest in zip(header.layers, dests, strict=True):
            check_payload(spec, dest, f"request {self.request_id} destination")
        loop = asyncio.get_running_loop()
        self.header, self._dests, self.seq, self.peer = header, dests, seq, peer
        self._canceller = canceller
        self._layer_futs = [_quiet_future(loop) for _ in header.layers]
        self.state = TransferState.ACTIVE
        self._started = time.perf_counter()
        self._header_fut.set_result(header)

    def landing(self, position: int) -> torch.Tensor:
        buf = landing_buffer(self._dests[position])
        self._landing[position] = buf
        return buf

    def mark_landed(self, position: int) -> None:
        scatter(self._landing.pop(position), self._dests[position])
        self.bytes_received += payload_nbytes(self._dests[position])
        self.landed += 1
        self._layer_futs[position].set_result(self._dests[position])

    @property
    def all_landed(self) -> bool:
        return self.header is not None and self.end_seen and self.landed == len(self.header.layers)

    def complete(self) -> TransferStats:
        assert self.header is not None
        stats = TransferStats(self.request_id, len(self.header.layers), self.bytes_received,
                              time.perf_counter() - self._started)
        self.state = TransferState.COMPLETE
        self._done_fut.set_result(stats)
        return stats

    def fail(self, exc: TransferError) -> None:
        if self.state.terminal:
            return
        self.state = TransferState.FAILED
        self._landing.clear()
        for fut in (self._header_fut, *self._layer_futs, self._done_fut):
            _settle(fut, exc)


class OutgoingTransfer:
    """Sender side of one request's KV transfer, created by ``engine.begin_send()``."""

    def __init__(self, header: TransferHeader, channel: SendChannel, seq: int, *, layer_timeout_s: float,
                 drain_timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self.header = header
        self.request_id = header.request_id
        self.channel = channel
        self.seq = seq
        self.state = TransferState.NEGOTIATING
        self.bytes_sent = 0
        self.next_position = 0
        self.accept_fut = _quiet_future(loop)
        self.done_fut = _quiet_future(loop)
        self._lock = asyncio.Lock()
        self._failure: TransferError | None = None
        self._layer_timeout_s = layer_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self._started = time.perf_counter()

    async def send_layer(self, payload: Payload) -> None:
        """Send the next layer (header order). Returns when the engine no longer needs the buffer."""
        self._raise_if_failed()
        async with self._lock:
            self._raise_if_failed()
            if self.next_position >= len(self.header.layers):
                raise ValueError(f"request {self.request_id}: all {len(self.header.layers)} layers already sent")
            spec = self.header.layers[self.next_position]
            check_payload(spec, payload, f"request {self.request_id} payload")
            try:
                await self.channel.send_payload(self.seq, self.next_position, payload)
            except TransferError as exc:
                self.fail(exc)
                raise self._failure or exc from None
            self.next_position += 1
            self.bytes_sent += spec.nbytes
        self._raise_if_failed()

    async def send_layers(self, payloads: Sequence[Payload]) -> None:
        """Send the next `len(payloads)` layers at once (header order): every layer's announcement and send
        are issued before the first completes, so the receiver posts all its receives at once instead of one
        control round trip per layer. Returns when the engine no longer needs any of the buffers."""
        self._raise_if_failed()
        async with self._lock:
            self._raise_if_failed()
            start = self.next_position
            specs = self.header.layers[start:start + len(payloads)]
            if len(specs) != len(payloads):
                raise ValueError(f"request {self.request_id}: {len(payloads)} layers from {start}, the header "
                                 f"has {len(self.header.layers)}")
            for spec, payload in zip(specs, payloads, strict=True):
                check_payload(spec, payload, f"request {self.request_id} payload")
            # Tasks start in creation order and each writes its announcement before its first await, so the
            # announcements go out in header order (what the receiver checks).
            results = await asyncio.gather(*(self.channel.send_payload(self.seq, start + i, p)
                                             for i, p in enumerate(payloads)), return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                exc = failures[0]
                if isinstance(exc, TransferError):
                    self.fail(exc)
                    raise self._failure or exc from None
                raise exc
            self.next_position += len(payloads)
            self.bytes_sent += sum(spec.nbytes for spec in specs)
        self._raise_if_failed()

    async def finish(self, timeout: float | None = None) -> TransferStats:
        """Send END and wait for the receiver's DONE (all bytes landed on the other side)."""
        self._raise_if_failed()
        if self.next_position != len(self.header.layers):
            raise ValueError(f"request {self.request_id}: finish() after {self.next_position} of "
                             f"{len(self.header.layers)} layers")
        await self.channel.send_end(self.seq)
        limit = self._layer_timeout_s if timeout is None else timeout
        try:
            await _bounded(self.done_fut, limit, f"request {self.request_id}: DONE from {self.channel.peer}")
        except TransferTimeout as exc:
            await self.abort(str(exc))
            raise
        except TransferError as exc:
            self.fail(exc)
            raise self._failure or exc from None
        self.state = TransferState.COMPLETE
        self.channel.forget_outgoing(self)
        return TransferStats(self.request_id, len(self.header.layers), self.bytes_sent,
                             time.perf_counter() - self._started)

    async def abort(self, reason: str = "aborted by sender") -> None:
        """Stop sending; the receiver's transfer fails with TransferAborted promptly."""
        if self.state.terminal:
            return
        self.fail(TransferAborted(f"request {self.request_id}: {reason}"))
        try:  # an in-flight payload must finish (or be cancelled) before ABORT goes out
            async with asyncio.timeout(self._drain_timeout_s):
                await self._lock.acquire()
        except TimeoutError:
            await self.channel.drop(TransferAborted(f"request {self.request_id}: send did not drain on abort"))
            return
        try:
            await self.channel.send_abort(self.seq, reason)
        finally:
            self._lock.release()

    def fail(self, exc: TransferError) -> None:
        if self.state.terminal:
            return
        self._failure = exc
        self.state = TransferState.FAILED
        _settle(self.accept_fut, exc)
        _settle(self.done_fut, exc)
        self.channel.forget_outgoing(self)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
