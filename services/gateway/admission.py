"""Backpressure: a bounded number of requests run downstream, a bounded number wait; the rest get 429."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class Overloaded(Exception):
    """No slot now and the wait queue is full (or the wait timed out): answer 429 with Retry-After."""


@dataclass(frozen=True)
class AdmissionConfig:
    """How many requests run downstream and wait at the gateway."""

    max_in_flight: int = 64
    """HTTP requests running downstream at once."""
    max_queued: int = 256
    """Requests waiting for a slot; beyond that: 429."""
    queue_timeout_s: float = 30.0
    """Longest wait for a slot before 429."""

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_queued < 0 or self.queue_timeout_s <= 0:
            raise ValueError(f"invalid AdmissionConfig {self}")


class Slot:
    """A held admission slot; `release()` is idempotent (the streaming path may call it twice)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._release()


class Admission:
    """FIFO admission control (asyncio.Semaphore wakes waiters in order)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._sem = asyncio.Semaphore(config.max_in_flight)
        self.in_flight = 0
        self.queued = 0

    async def enter(self) -> Slot:
        """A slot, after waiting at most `queue_timeout_s`; Overloaded when the queue is full or the wait ends."""
        if self._sem.locked() and self.queued >= self.config.max_queued:
            raise Overloaded(f"{self.in_flight} requests running and {self.queued} queued (the limit)")
        self.queued += 1
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                await self._sem.acquire()
        except TimeoutError:
            raise Overloaded(f"no free slot within {self.config.queue_timeout_s}s") from None
        finally:
            self.queued -= 1
        self.in_flight += 1
        return Slot(self)

    def _release(self) -> None:
        self.in_flight -= 1
        self._sem.release()
