"""AsyncEngine: EngineCore's step loop on a dedicated thread, per-request asyncio output queues.

Services call `async for out in engine.generate(req)`. Leaving the loop early (break, client
disconnect, task cancellation) aborts the request, which frees its KV. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from libs.engine.core import EngineCore
from libs.engine.placement import parse_cpus, pin_this_thread
from libs.engine.request import Request, RequestOutput

log = logging.getLogger(__name__)

# What a prefetch hook returns: work for the engine thread to run right before the request is added (the GCache
# import into the host tier), or None.
Prefetched = Callable[[EngineCore], None] | None


class EngineDeadError(RuntimeError):
    """The engine's step loop stopped (crashed or was shut down) while a request was in flight."""


class AsyncEngine:
    """Drives an EngineCore from a background thread.

    idle_wait_s: how long the loop sleeps on its command queue when there is no work.
    output_timeout_s: longest wait for a request's next output before generate() raises.
    """

    def __init__(self, core: EngineCore, *, idle_wait_s: float = 0.05, output_timeout_s: float = 300.0) -> None:
        if idle_wait_s <= 0 or output_timeout_s <= 0:
            raise ValueError("AsyncEngine: idle_wait_s and output_timeout_s must be > 0")
        self.core = core
        self.idle_wait_s = idle_wait_s
        self.output_timeout_s = output_timeout_s
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # set when a short request is queued: a step of long prefill chunks stops at the next layer for it
        self._urgent = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._step_hook: Callable[[EngineCore, bool], None] | None = None
        self._prefetch: Callable[[Request], Awaitable[Prefetched]] | None = None
        self._rounds = 0  # rounds the step loop has begun (`rounds`)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("engine step loop did not stop within %.1fs", timeout_s)
        self._fail_all(EngineDeadError("engine shut down"))

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def thread_alive(self) -> bool:
        """The step loop's thread still runs (after `fail`: it is stuck in its round)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> BaseException | None:
        """Why the step loop is dead (its crash, or `fail`'s cause), else None."""
        return self._error

    @property
    def rounds(self) -> int:
        """Rounds the step loop has begun. A round is its commands, one step, the hook, or an idle wait of at most
        `idle_wait_s`, so a count that does not move for far longer than one step means the loop is stuck (a dead
        lock, a kernel that never returns): the worker's engine watch (libs/worker/service.py) reads it."""
        return self._rounds

    def fail(self, exc: BaseException) -> None:
        """Declare the step loop dead from outside (it is stuck in a round that does not return): every stream
        and queued command gets `exc` now, later calls raise EngineDeadError, and should the round ever return
        the loop stops."""
        self._error = exc
        self._stop.set()
        self._fail_all(exc)

    # ------------------------------------------------------------------ public API
    def set_step_hook(self, hook: Callable[[EngineCore, bool], None] | None) -> None:
        """Run `hook(core, idle)` on the engine thread after every round of the loop (commands, then a step
        when there is work); `idle` = no work is left, the loop is about to wait for commands (up to
        `idle_wait_s`). For cheap bookkeeping that must see every step without a command round trip (the
        worker's KV event publisher): it must be quick, and an exception is logged, never stops the loop."""
        self._step_hook = hook

    def set_prefetch(self, hook: Callable[[Request], Awaitable[Prefetched]] | None) -> None:
        """Await `hook(req)` on the caller's loop before `generate` adds a request; what it returns runs on the
        engine thread in the same command as `add_request`, right before it (the GCache lookup fetches an L3
        hit, then imports it into the host tier: libs/worker/gcache.py). The hook bounds its own time and
        never raises (a failure is a miss); an exception from either part is logged and the request goes on."""
        self._prefetch = hook

    async def call(self, fn: Callable[[EngineCore], Any], timeout_s: float | None = None, *,
                   urgent: bool = False) -> Any:
        """Run fn(core) on the engine thread between steps and return its result. `urgent` lets it stop a
        step of long prefill chunks at the next layer instead of waiting for the step to end."""
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((lambda: fn(self.core), fut))
        if urgent:
            self._urgent.set()
        async with asyncio.timeout(timeout_s or self.output_timeout_s):
            return await asyncio.wrap_future(fut)

    async def abort(self, req_id: str) -> bool:
        return await self.call(lambda core: core.abort(req_id))

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Submit req and yield its outputs until the finished one; aborts it if left early."""
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if req.req_id in self._streams:
                raise ValueError(f"request id {req.req_id!r} is already streaming")
            self._streams[req.req_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            action = await self._prefetched(req)
            await self.call(lambda core: _add(core, req, action), urgent=self.core.is_urgent(req))
            while not finished:
                item = await self._next(stream, req.req_id)
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(req.req_id, None)
            if not finished and self.is_running:
                self._commands.put((lambda: self.core.abort(req.req_id), concurrent.futures.Future()))

    async def _prefetched(self, req: Request) -> Prefetched:
        if self._prefetch is None:
            return None
        try:
            return await self._prefetch(req)
        except Exception:
            log.exception("prefetch of request %s failed; it goes on without", req.req_id)
            return None

    async def _next(self, stream: asyncio.Queue, req_id: str) -> RequestOutput:
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that lands while the
            # inner get completes, and with outputs arriving every millisecond that race is common
            async with asyncio.timeout(self.output_timeout_s):
                item = await stream.get()
        except TimeoutError:
            raise TimeoutError(f"request {req_id!r}: no output from the engine in {self.output_timeout_s}s") from None
        if isinstance(item, BaseException):
            raise EngineDeadError(f"request {req_id!r}: engine step loop failed ({item})") from item
        return item

    # ------------------------------------------------------------------ loop thread
    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError("engine step loop has failed") from self._error
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("engine is not running (call start() or use `async with`)")

    def _loop(self) -> None:
        try:
            pin_this_thread(parse_cpus(self.core.config.compute_cpus))
            while not self._stop.is_set():
                self._rounds += 1
                self._run_commands(block=not self.core.has_work())
                if self.core.has_work():
                    self._dispatch(self.core.step(interrupt=self._interrupt_now))
                if self._step_hook is not None:
                    self._run_hook(self._step_hook)
        except BaseException as exc:  # the loop must never die silently
            log.exception("engine step loop crashed")
            self._error = exc
            self._fail_all(exc)

    def _run_hook(self, hook: Callable[[EngineCore, bool], None]) -> None:
        try:
            hook(self.core, not self.core.has_work())
        except Exception:
            log.exception("engine step hook failed")

    def _interrupt_now(self) -> bool:
        # the flag alone could be stale (its command already ran): a queued command must be waiting too
        return self._urgent.is_set() and not self._commands.empty()

    def _run_commands(self, block: bool) -> None:
        self._urgent.clear()  # before draining: a short request queued from here on sets it again
        try:
            item = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            # A caller that stopped waiting (cancelled, timed out) has cancelled its future. The command runs
            # anyway, since callers rely on queued effects (an abort, a release), but its result goes nowhere;
            # setting it on the cancelled future would raise and kill this loop.
            waited_for = fut.set_running_or_notify_cancel()
            try:
                result = fn()
            except Exception as exc:  # reported to the caller, the loop goes on
                if waited_for:
                    fut.set_exception(exc)
            else:
                if waited_for:
                    fut.set_result(result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                target = self._streams.get(out.req_id)
            if target is not None:
                loop, stream = target
                loop.call_soon_threadsafe(stream.put_nowait, out)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            targets = list(self._streams.values())
        for loop, stream in targets:
            if not loop.is_closed():
                loop.call_soon_threadsafe(stream.put_nowait, exc)
        while True:  # unblock callers waiting on commands
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError("engine stopped before running the command"))


def _add(core: EngineCore, req: Request, prefetched: Prefetched) -> None:
    if prefetched is not None:
        try:
            prefetched(core)
        except Exception:  # a failed import is a miss, never a failed request
            log.exception("importing the prefetched KV of request %s failed", req.req_id)
    core.add_request(req)
