"""Typed NATS bus: request/reply, pub/sub, queue groups, large payloads, reconnect handling.

Wire conventions (both sides live in this module):
- body = orjson of a protos model;
- header `Windserve-Status: error` marks an ErrorReply instead of the normal reply;
- header `Windserve-Payload-Ref: <name>` means the body is empty and the real bytes sit in the
  JetStream object store bucket `windserve_payloads` under <name>. Used above `large_threshold`
  (512 KiB, always below the server's max_payload) so a huge prompt never hits max_payload.
  Request/reply payloads are deleted by the reader; broadcast ones expire with the bucket TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig
from nats.js.object_store import ObjectStore
from nats.nuid import NUID
from pydantic import BaseModel

from libs.bus import metrics
from libs.bus.errors import BusError, BusTimeout, NoResponders, RemoteError, Unavailable
from protos import subjects
from protos.base import ProtocolError, decode, encode
from protos.messages import ErrorCode, ErrorReply

log = logging.getLogger("windserve.bus")

HDR_STATUS = "Windserve-Status"
HDR_REF = "Windserve-Payload-Ref"
STATUS_ERROR = "error"
_HEADER_ROOM = 16 * 1024  # headers + protocol overhead kept free below max_payload

Req = TypeVar("Req", bound=BaseModel)
Rep = TypeVar("Rep", bound=BaseModel)
Handler = Callable[[Req], Awaitable[BaseModel]]
T = TypeVar("T")


async def _keep_cancel(aw: Awaitable[T]) -> T:
    """Await `aw`, then re-raise a cancellation of this task that `aw` swallowed.

    nats-py waits for replies and messages with `asyncio.wait_for`, which on Python 3.11 returns the
    result when a cancel lands just as the result arrives. The cancelled caller would then go on as
    if nothing happened: a gateway whose client left kept streaming instead of aborting.
    `Task.cancelling()` still counts the swallowed request, so it can be raised here."""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    result = await aw
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError
    return result


@dataclass(frozen=True)
class BusConfig:
    """Connection and payload settings of a Bus."""

    connect_timeout_s: float = 5.0
    reconnect_wait_s: float = 1.0
    max_reconnect_attempts: int = -1  # -1: keep trying forever (a service outlives NATS restarts)
    large_threshold: int = 512 * 1024
    payload_bucket: str = subjects.PAYLOAD_BUCKET
    payload_ttl_s: float = 600.0  # orphaned large payloads (dead reader) expire after this
    payload_replicas: int = 1  # replicas of the payload store when this bus creates it (3 on a 3-node cluster)
    drain_timeout_s: float = 5.0
    ping_interval_s: float = 1.0  # a hung server (SIGSTOP, a frozen VM: its socket stays open) is left for another
    max_outstanding_pings: int = 2  # node of the cluster after this many unanswered pings (~3-4 s; nats-py: 240 s)

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.reconnect_wait_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("BusConfig timeouts must be > 0")
        if self.large_threshold < 1024:
            raise ValueError(f"large_threshold {self.large_threshold} is too small (min 1024 bytes)")
        if self.payload_ttl_s < 1:
            raise ValueError("payload_ttl_s must be >= 1 s")
        if self.payload_replicas < 1:
            raise ValueError("payload_replicas must be >= 1")


def subject_family(subject: str) -> str:
    """Metric label for a subject: its first two tokens, so per-instance subjects don't explode."""
    return ".".join(subject.split(".")[:2])


def _connect_cause(exc: BaseException) -> str:
    """The reason a connect failed, in words: nats-py reports a refused connection as a bare timeout or
    NoServersError, so name the usual cause."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused: nothing listens on that port"
    if isinstance(exc, (TimeoutError, nats.errors.TimeoutError, nats.errors.NoServersError)):
        return "no server answered"
    return repr(exc)


def _is_error(msg: Msg) -> bool:
    return msg.headers is not None and msg.headers.get(HDR_STATUS) == STATUS_ERROR


class Bus:
    """One NATS connection with typed helpers. Create with `await Bus.connect(...)`."""

    def __init__(self, nc: NATS, name: str, config: BusConfig) -> None:
        self._nc = nc
        self.name = name
        self.config = config
        self._js: JetStreamContext = nc.jetstream()
        self._store: ObjectStore | None = None
        self._store_lock = asyncio.Lock()
        self._nuid = NUID()
        self._servers: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()

    # --- lifecycle --------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls, url: str, name: str, timeout: float = 5.0, config: BusConfig | None = None
    ) -> Bus:
        """Connect to NATS at `url`; raise BusError naming the URL if it is unreachable in time."""
        cfg = config or BusConfig(connect_timeout_s=timeout)
        nc = NATS()

        async def on_error(exc: Exception) -> None:
            metrics.CONNECTION_EVENTS.labels("error").inc()
            log.warning("nats error", extra={"bus": name, "error": repr(exc)})

        async def on_disconnect() -> None:
            metrics.CONNECTION_EVENTS.labels("disconnected").inc()
            closing = nc.is_draining or nc.is_closed  # our own close(), not a failure
            log.log(logging.INFO if closing else logging.WARNING, "nats disconnected", extra={"bus": name})

        async def on_reconnect() -> None:
            metrics.CONNECTION_EVENTS.labels("reconnected").inc()
            log.info("nats reconnected", extra={"bus": name, "url": str(nc.connected_url)})

        async def on_closed() -> None:
            metrics.CONNECTION_EVENTS.labels("closed").inc()
            log.info("nats connection closed", extra={"bus": name})

        try:
            async with asyncio.timeout(timeout):
                await nc.connect(
                    servers=[u.strip() for u in url.split(",") if u.strip()],  # a cluster: several URLs
                    name=name,
                    connect_timeout=max(1, int(timeout)),
                    allow_reconnect=True,
                    reconnect_time_wait=cfg.reconnect_wait_s,  # type: ignore[arg-type]
                    max_reconnect_attempts=cfg.max_reconnect_attempts,
                    ping_interval=cfg.ping_interval_s,  # type: ignore[arg-type]
                    max_outstanding_pings=cfg.max_outstanding_pings,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    closed_cb=on_closed,
                )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            with contextlib.suppress(Exception):
                await nc.close()
            raise BusError(f"cannot connect to NATS at {url} within {timeout}s ({_connect_cause(exc)}): is "
                           "nats-server running there? (WINDSERVE_NATS_URL names it)") from exc
        metrics.CONNECTION_EVENTS.labels("connected").inc()
        return cls(nc, name, cfg)

    @property
    def nc(self) -> NATS:
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        return self._js

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    @property
    def large_threshold(self) -> int:
        """Payloads above this many bytes go through the object store."""
        return min(self.config.large_threshold, self._nc.max_payload - _HEADER_ROOM)

    async def stop_serving(self) -> None:
        """Unsubscribe every `serve()` subscription: no new requests are accepted. Drained, not dropped: a
        request the server routed here before it saw the unsubscribe is still handled (answered, e.g. "busy"
        while draining) instead of left unanswered until its asker's timeout (seen under compose's scale-down:
        3 requests waited out the gateway's 30 s ack bound). Bounded: a hung server costs at most 2 s."""
        servers, self._servers = self._servers, []
        if not servers:
            return
        drains = [asyncio.ensure_future(sub.drain()) for sub in servers]
        await asyncio.wait(drains, timeout=2.0)
        for sub, drain in zip(servers, drains, strict=True):
            if not drain.done() or drain.cancelled() or drain.exception() is not None:
                drain.cancel()
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def drain_handlers(self, timeout: float) -> bool:
        """Wait up to `timeout` for in-flight handlers; cancel the rest. True if all finished."""
        if not self._tasks:
            return True
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            log.warning("cancelled handlers still running after drain", extra={"count": len(pending)})
        return not pending

    async def close(self) -> None:
        """Stop serving, drain handlers and the connection (bounded), then close."""
        if self._nc.is_closed:
            return
        await self.stop_serving()
        await self.drain_handlers(self.config.drain_timeout_s)
        try:
            async with asyncio.timeout(self.config.drain_timeout_s):
                await self._nc.drain()
        except Exception as exc:  # a dead server must not block shutdown
            log.warning("nats drain failed, closing", extra={"error": repr(exc)})
        if not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.close()

    # --- large payloads ---------------------------------------------------------------------

    async def ensure_replicas(self, stream: str, replicas: int) -> None:
        """Raise JetStream stream `stream` to `replicas` replicas if it has fewer (never lowers them). On a cluster
        the servers copy its data to the new replicas; on a single server more than 1 is refused (an error)."""
        info = await self._js.stream_info(stream)
        if info.config.num_replicas is not None and info.config.num_replicas >= replicas:
            return
        info.config.num_replicas = replicas
        await self._js.update_stream(info.config)
        log.info("stream replicas raised", extra={"stream": stream, "replicas": replicas})

    async def _payload_store(self) -> ObjectStore:
        async with self._store_lock:
            if self._store is None:
                bucket = self.config.payload_bucket
                try:
                    self._store = await self._js.object_store(bucket)
                    if self.config.payload_replicas > 1:
                        await self.ensure_replicas(f"OBJ_{bucket}", self.config.payload_replicas)
                except nats.js.errors.BucketNotFoundError:
                    self._store = await self._js.create_object_store(
                        bucket, config=ObjectStoreConfig(ttl=self.config.payload_ttl_s,
                                                         replicas=self.config.payload_replicas)
                    )
            return self._store

    async def ensure_payload_store(self) -> None:
        """Create the payload store now (with `payload_replicas`) if missing, not at the first large payload."""
        await self._payload_store()

    async def _pack(self, data: bytes, headers: dict[str, str] | None = None) -> tuple[bytes, dict[str, str]]:
        hdrs = dict(headers or {})
        if len(data) <= self.large_threshold:
            return data, hdrs
        store = await self._payload_store()
        name = self._nuid.next().decode()
        await store.put(name, data)
        metrics.LARGE_PAYLOADS.labels("out").inc()
        hdrs[HDR_REF] = name
        return b"", hdrs

    async def _unpack(self, msg: Msg, consume: bool) -> bytes:
        ref = msg.headers.get(HDR_REF) if msg.headers else None
        if not ref:
            return bytes(msg.data)
        store = await self._payload_store()
        try:
            result = await store.get(ref)
        except nats.js.errors.ObjectNotFoundError as exc:
            raise BusError(f"large payload {ref!r} is gone (expired after {self.config.payload_ttl_s}s?)") from exc
        metrics.LARGE_PAYLOADS.labels("in").inc()
        if consume:
            try:
                await store.delete(ref)
            except Exception as exc:  # TTL cleans up what we fail to delete
                log.warning("could not delete large payload", extra={"ref": ref, "error": repr(exc)})
        return bytes(result.data or b"")

    # --- request / reply --------------------------------------------------------------------

    async def request(self, subject: str, msg: BaseModel, reply_model: type[Rep], timeout: float) -> Rep:
        """Send `msg`, wait up to `timeout` s for a reply decoded as `reply_model`.

        Raises BusTimeout, NoResponders, RemoteError (the peer answered ErrorReply) or ProtocolError.
        """
        family = subject_family(subject)
        start = time.monotonic()
        outcome = "error"
        try:
            async with asyncio.timeout(timeout):
                data, hdrs = await self._pack(encode(msg))
                reply = await _keep_cancel(self._nc.request(subject, data, timeout=timeout, headers=hdrs or None))
                body = await self._unpack(reply, consume=True)
            if _is_error(reply):
                err = decode(body, ErrorReply)
                outcome = "remote_error"
                raise RemoteError(subject, err.code, err.message)
            result = decode(body, reply_model)
            outcome = "ok"
            return result
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            outcome = "timeout"
            raise BusTimeout(f"no reply on {subject} within {timeout}s") from exc
        except nats.errors.NoRespondersError as exc:
            outcome = "no_responders"
            raise NoResponders(f"no service is listening on {subject}") from exc
        finally:
            metrics.REQUESTS.labels(family, outcome).inc()
            metrics.REQUEST_SECONDS.labels(family).observe(time.monotonic() - start)

    async def serve(
        self, subject: str, request_model: type[Req], handler: Handler[Req], queue: str | None = None
    ) -> Subscription:
        """Answer requests on `subject` with `handler` (one task per message).

        A malformed message or a raising handler is logged and answered with an ErrorReply; the
        service keeps running. With `queue`, one member of the group gets each message.
        """

        async def on_message(raw: Msg) -> None:
            task = asyncio.create_task(self._handle(subject, raw, request_model, handler))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        sub = await self._nc.subscribe(subject, queue=queue or "", cb=on_message)
        self._servers.append(sub)
        await self.flush()  # the server knows the subscription when serve() returns
        return sub

    async def _handle(self, subject: str, raw: Msg, model: type[Req], handler: Handler[Req]) -> None:
        family = subject_family(subject)
        metrics.IN_FLIGHT.inc()
        try:
            try:
                request = decode(await self._unpack(raw, consume=True), model)
            except (ProtocolError, BusError) as exc:
                log.warning("malformed request", extra={"subject": raw.subject, "error": str(exc)})
                metrics.HANDLED.labels(family, "bad_request").inc()
                await self._reply_error(raw, ErrorCode.BAD_REQUEST, str(exc))
                return
            try:
                reply = await handler(request)
            except Unavailable as exc:
                log.info("request refused", extra={"subject": raw.subject, "error": str(exc)})
                metrics.HANDLED.labels(family, "unavailable").inc()
                await self._reply_error(raw, ErrorCode.UNAVAILABLE, str(exc))
                return
            except Exception as exc:
                log.exception("handler failed", extra={"subject": raw.subject})
                metrics.HANDLED.labels(family, "internal").inc()
                await self._reply_error(raw, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
                return
            metrics.HANDLED.labels(family, "ok").inc()
            await self._reply(raw, encode(reply), {})
        except Exception:  # replying itself failed (connection lost): log, never crash the service
            log.exception("could not answer request", extra={"subject": raw.subject})
        finally:
            metrics.IN_FLIGHT.dec()

    async def _reply(self, raw: Msg, data: bytes, headers: dict[str, str]) -> None:
        if not raw.reply:
            return  # a publish, not a request: nobody waits for an answer
        body, hdrs = await self._pack(data, headers)
        await self._nc.publish(raw.reply, body, headers=hdrs or None)

    async def _reply_error(self, raw: Msg, code: ErrorCode, message: str) -> None:
        await self._reply(raw, encode(ErrorReply(code=code, message=message)), {HDR_STATUS: STATUS_ERROR})

    # --- pub / sub --------------------------------------------------------------------------

    async def publish(self, subject: str, msg: BaseModel) -> None:
        """Fire-and-forget publish (large payloads expire with the payload bucket TTL)."""
        data, hdrs = await self._pack(encode(msg))
        await self._nc.publish(subject, data, headers=hdrs or None)

    async def subscribe(self, subject: str, model: type[Req], queue: str | None = None) -> TypedSubscription[Req]:
        """Subscribe and iterate decoded messages; malformed ones are logged and skipped."""
        sub = await self._nc.subscribe(subject, queue=queue or "")
        try:
            await self.flush()  # no message published after subscribe() returns can be missed
        except BaseException:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # (the caller never gets it: it would deliver into nothing)
            raise
        return TypedSubscription(self, sub, model)

    async def flush(self, timeout: float = 2.0) -> None:
        await self._nc.flush(timeout=max(1, int(timeout)))


class TypedSubscription(AsyncIterator[Req]):
    """Async iterator over decoded messages of one subscription."""

    def __init__(self, bus: Bus, sub: Subscription, model: type[Req]) -> None:
        self._bus = bus
        self._sub = sub
        self._model = model

    async def next(self, timeout: float) -> Req:
        """Next valid message within `timeout` seconds, else BusTimeout."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BusTimeout(f"no message on {self._sub.subject} within {timeout}s")
            try:
                raw = await _keep_cancel(self._sub.next_msg(timeout=remaining))
            except nats.errors.TimeoutError as exc:
                raise BusTimeout(f"no message on {self._sub.subject} within {timeout}s") from exc
            decoded = await self._decode(raw)
            if decoded is not None:
                return decoded

    async def _decode(self, raw: Msg) -> Req | None:
        try:
            return decode(await self._bus._unpack(raw, consume=False), self._model)
        except (ProtocolError, BusError) as exc:
            log.warning("dropping malformed message", extra={"subject": raw.subject, "error": str(exc)})
            return None

    def __aiter__(self) -> TypedSubscription[Req]:
        return self

    async def __anext__(self) -> Req:
        while True:
            try:
                raw = await _keep_cancel(self._sub.next_msg(timeout=None))  # type: ignore[arg-type]
            except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError) as exc:
                raise StopAsyncIteration from exc
            decoded = await self._decode(raw)
            if decoded is not None:
                return decoded

    async def unsubscribe(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

