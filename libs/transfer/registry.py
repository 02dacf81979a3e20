"""What every control connection of one engine shares: its transfers by request id and its tasks.

Receiver side: ``expect()`` registers an ``IncomingTransfer`` (EXPECTED) under its request id; a
HEADER claims it (-> active) after waiting up to ``register_grace_s`` for a late ``expect()``; it
leaves the registry when it completes or fails, and a COMPLETE one adds to ``bytes_received``.
Sender side: ``begin_send`` adds the ``OutgoingTransfer``; a COMPLETE one adds to ``bytes_sent``.
A request id is in at most one of these maps per side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from .config import TransferConfig
from .errors import TransferError, TransferTimeout
from .transfers import Destinations, IncomingTransfer, OutgoingTransfer, TransferState

log = logging.getLogger("windserve.transfer")


class TaskSet:
    """Background tasks of one engine, kept referenced until done; ``close()`` cancels the rest."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self, timeout_s: float = 10.0) -> None:
        """Cancel the tasks and wait for them, bounded (a task that swallows its cancellation is logged and
        left, never waited for forever)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        done, stuck = await asyncio.wait(tasks, timeout=timeout_s)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: an error at shutdown is no news
        if stuck:
            log.error("transfer tasks did not stop after cancellation", extra={"tasks": len(stuck)})


class TransferRegistry:
    """The transfers of one engine by request id, its byte totals and its background tasks."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.label = ""  # the engine's address, for messages (set by start())
        self.tasks = TaskSet()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._expected: dict[str, IncomingTransfer] = {}
        self._active_in: dict[str, IncomingTransfer] = {}
        self._outgoing: dict[str, OutgoingTransfer] = {}
        # The header deadline of each expected transfer, cancelled once it leaves EXPECTED: a pending timer
        # would keep the transfer, and through it the caller's destination buffers, alive until it fires.
        self._header_timers: dict[str, asyncio.TimerHandle] = {}
        self._registered = asyncio.Condition()
        # MESSAGE frames (outside transfers) go to the engine's handler: (connection, msg id, body); a connection
        # that drops tells every drop listener (connection, error). Typed loosely: this module imports no
        # connection code.
        self.message_handler: Callable[[Any, int, bytes], None] | None = None
        self.drop_listeners: list[Callable[[Any, TransferError], None]] = []

    # -- receiver side ---------------------------------------------------------------------
    def expect(self, request_id: str, destinations: Destinations) -> IncomingTransfer:
        if self.incoming(request_id) is not None:
            raise ValueError(f"request {request_id!r} is already expected on {self.label}")
        tr = IncomingTransfer(request_id, destinations, layer_timeout_s=self.config.layer_timeout_s,
                              canceller=self._cancel_unbound)
        self._expected[request_id] = tr
        self._header_timers[request_id] = asyncio.get_running_loop().call_later(
            self.config.header_timeout_s, self._expire, tr)
        self.tasks.spawn(self._notify_registered())
        return tr

    def incoming(self, request_id: str) -> IncomingTransfer | None:
        return self._expected.get(request_id) or self._active_in.get(request_id)

    async def claim(self, request_id: str) -> IncomingTransfer | None:
        """Move an expected transfer to active, waiting up to the grace for a late expect()."""
        async with self._registered:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.register_grace_s):
                    await self._registered.wait_for(lambda: request_id in self._expected)
        tr = self._expected.pop(request_id, None)
        if tr is not None:
            self._cancel_header_timer(request_id)
            self._active_in[request_id] = tr
        return tr

    def incoming_finished(self, tr: IncomingTransfer) -> None:
        if self._active_in.get(tr.request_id) is tr:
            del self._active_in[tr.request_id]
            if tr.state is TransferState.COMPLETE:
                self.bytes_received += tr.bytes_received
        if self._expected.get(tr.request_id) is tr:
            del self._expected[tr.request_id]
            self._cancel_header_timer(tr.request_id)

    def _cancel_header_timer(self, request_id: str) -> None:
        timer = self._header_timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()  # (drops its reference to the transfer at once)

    # -- sender side -------------------------------------------------------------------------
    def add_outgoing(self, tx: OutgoingTransfer) -> None:
        if tx.request_id in self._outgoing:
            raise ValueError(f"request {tx.request_id!r} is already being sent from {self.label}")
        self._outgoing[tx.request_id] = tx

    def outgoing(self, request_id: str) -> OutgoingTransfer | None:
        return self._outgoing.get(request_id)

    def outgoing_finished(self, tx: OutgoingTransfer) -> None:
        if self._outgoing.get(tx.request_id) is tx:
            del self._outgoing[tx.request_id]
            if tx.state is TransferState.COMPLETE:
                self.bytes_sent += tx.bytes_sent

    # -- messages ---------------------------------------------------------------------------
    def on_message(self, conn: Any, msg_id: int, body: bytes) -> None:
        if self.message_handler is None:
            log.warning("MESSAGE frame with no handler dropped", extra={"msg_id": msg_id})
            return
        self.message_handler(conn, msg_id, body)

    def dropped(self, conn: Any, err: TransferError) -> None:
        for listener in list(self.drop_listeners):
            try:
                listener(conn, err)
            except Exception:  # one listener's bug must not keep the others from hearing of the drop
                log.exception("transfer drop listener failed")

    # -- lifecycle ---------------------------------------------------------------------------
    async def close(self, err: TransferError) -> None:
        """Fail every incoming transfer not yet failed by its connection; cancel background tasks."""
        for tr in [*self._expected.values(), *self._active_in.values()]:
            tr.fail(err)
        self._expected.clear()
        self._active_in.clear()
        for timer in self._header_timers.values():
            timer.cancel()
        self._header_timers.clear()
        await self.tasks.close()

    async def _notify_registered(self) -> None:
        async with self._registered:
            self._registered.notify_all()

    def _expire(self, tr: IncomingTransfer) -> None:
        if tr.state is TransferState.EXPECTED:
            tr.fail(TransferTimeout(f"request {tr.request_id}: no header within {self.config.header_timeout_s:.3g}s"))
            self.incoming_finished(tr)

    async def _cancel_unbound(self, tr: IncomingTransfer, err: TransferError) -> None:
        # No header bound it to a connection yet, so nothing can be in flight into its buffers.
        tr.fail(err)
        self.incoming_finished(tr)
