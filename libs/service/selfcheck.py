"""The bus self-check: a service whose event loop runs but whose NATS subscriptions are gone exits, so its restart
policy brings it back (compose `restart: unless-stopped`, Kubernetes, the `make run` supervisor).

`BusSelfCheck` asks the service's own health subject every `interval_s` (each ask bounded by `timeout_s`).
Failed asks while the connection is up and the service is RUNNING accumulate time; at `limit_s` the service
logs why and exits with `EXIT_CODE`. An answer resets it, and so does an ask while NATS is down (NATS's
outage, not the service's). Like the loop watchdog (watchdog.py), it counts observed time only, so a process
resumed after a SIGSTOP is judged on what it does next. Details: docs/reliability.md, "Liveness and
readiness".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from libs.bus import Bus, BusError
from protos.messages import HealthReply, HealthRequest

log = logging.getLogger("windserve.selfcheck")

EXIT_CODE = 69  # EX_UNAVAILABLE: the supervisor's log names it


class BusSelfCheck:
    """Ask `subject` (the service's own health subject) every `interval_s`; `on_fail(reason)` once its asks have
    failed for `limit_s` of observed time while `bus` is connected and `active()` holds."""

    def __init__(self, bus: Bus, subject: str, instance_id: str, limit_s: float, on_fail: Callable[[str], None],
                 active: Callable[[], bool] = lambda: True, interval_s: float | None = None,
                 timeout_s: float | None = None) -> None:
        if limit_s <= 0:
            raise ValueError("BusSelfCheck: limit_s must be > 0")
        self.bus = bus
        self.subject = subject
        self.instance_id = instance_id
        self.limit_s = limit_s
        self.interval_s = interval_s if interval_s is not None else min(5.0, limit_s / 4)
        self.timeout_s = timeout_s if timeout_s is not None else min(2.0, self.interval_s)
        self._on_fail = on_fail
        self._active = active
        self.failing_s = 0.0
        """Observed time the asks have failed in a row (while connected and active)."""
        self.asks = 0
        """Asks answered by this instance (for tests and health details)."""

    async def run(self) -> None:
        """Until `on_fail` is called (then return) or cancelled."""
        last = time.monotonic()
        cap = 2 * self.interval_s + self.timeout_s
        while True:
            await asyncio.sleep(self.interval_s)
            failure = await self._ask()
            now = time.monotonic()
            waited, last = min(now - last, cap), now
            if failure is None:
                self.failing_s = 0.0
                continue
            self.failing_s += waited
            if self.failing_s >= self.limit_s:
                self._on_fail(f"this instance's own health subscription ({self.subject}) has not answered it over "
                              f"the bus for {self.failing_s:.1f}s while the NATS connection is up (last ask: "
                              f"{failure}): its subscriptions are gone")
                return

    async def _ask(self) -> str | None:
        """None when the ask was answered by this instance, or does not count (connection down, not active); else
        why it failed."""
        if not self.bus.is_connected or not self._active():
            return None
        try:
            reply = await self.bus.request(self.subject, HealthRequest(), HealthReply, self.timeout_s)
        except Exception as exc:  # no responders, no reply in time, a nats client error
            if not self.bus.is_connected or not self._active():  # the connection dropped meanwhile: NATS's outage
                return None
            return str(exc) if isinstance(exc, BusError) else repr(exc)
        if reply.instance_id != self.instance_id:
            return f"answered by {reply.instance_id}, not this instance"
        self.asks += 1
        return None
