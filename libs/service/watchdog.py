"""The event-loop watchdog: a service whose asyncio loop stops running exits, so its restart policy brings it
back (compose `restart: unless-stopped`, Kubernetes, the `make run` supervisor).

A stalled loop answers nothing, yet its process stays up, and Docker restarts an exited container, never an
unhealthy one. `LoopWatchdog` is a daemon thread watching a tick the loop posts every `tick_s`; once the tick
has not moved for `stall_s` of observed time it logs which loop stalled and for how long, then ends the
process with `EXIT_CODE`. A check that wakes late (SIGSTOP, starvation) counts at most two periods, so a
resumed process is judged on what it does next.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("windserve.watchdog")

EXIT_CODE = 70  # EX_SOFTWARE: the supervisor's log names it


class LoopWatchdog:
    """Watch the running loop of `start()`'s caller; `on_stall(stalled_s)` defaults to logging and exiting."""

    def __init__(self, stall_s: float, name: str, on_stall: Callable[[float], None] | None = None) -> None:
        if stall_s <= 0:
            raise ValueError("LoopWatchdog: stall_s must be > 0")
        self.stall_s = stall_s
        self.name = name
        self.period_s = min(1.0, stall_s / 4)
        self._on_stall = on_stall or self._exit
        self._ticks = 0
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Call on the loop to watch."""
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="watchdog-tick")
        self._thread = threading.Thread(target=self._watch, name=f"watchdog-{self.name}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 2 * self.period_s + 1)

    async def _tick(self) -> None:
        while True:
            self._ticks += 1
            await asyncio.sleep(self.period_s / 2)

    def _watch(self) -> None:
        seen, stalled, last = self._ticks, 0.0, time.monotonic()
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            waited, last = min(now - last, 2 * self.period_s), now  # a late wake-up counts two periods at most
            if self._ticks != seen:
                seen, stalled = self._ticks, 0.0
                continue
            stalled += waited
            if stalled >= self.stall_s:
                self._on_stall(stalled)
                return

    def _exit(self, stalled_s: float) -> None:
        log.critical("event loop stalled: exiting so that the restart policy restarts this service",
                     extra={"service": self.name, "stalled_s": round(stalled_s, 1), "exit_code": EXIT_CODE})
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # noqa: S110 - exiting anyway
                pass
        os._exit(EXIT_CODE)
