"""The request-task registry of an engine worker: one asyncio task per in-flight request, by request id.

`RequestTasks.spawn` refuses an id that is running (`DuplicateRequest`) and runs `aborted` instead for an
id whose abort arrived first (aborts can overtake their request on the bus); the coroutine not started is
closed, never awaited. `cancel` cancels a task or remembers its id (bounded: the newest `remember` ids);
`abort` also waits, bounded, for the task's cleanup; `drain(timeout_s)` lets tasks finish, then cancels the
rest. Pure asyncio. A task owns its cleanup (`finally:` aborts or releases the engine request), so
cancelling it stops the request everywhere. Rules: docs/worker.md, "Request tasks, aborts, drain".
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Coroutine, Iterator
from typing import Any

log = logging.getLogger("windserve.worker.tasks")

RequestCoroutine = Coroutine[Any, Any, None]


class DuplicateRequest(ValueError):
    """A request id that is already running on this worker arrived again."""


class RequestTasks:
    """In-flight requests of one engine worker (see the module docstring for the rules)."""

    def __init__(self, remember: int = 4096) -> None:
        if remember < 1:
            raise ValueError(f"RequestTasks: remember must be >= 1, got {remember}")
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._aborted: OrderedDict[str, None] = OrderedDict()  # insertion order = age (oldest dropped first)
        self._remember = remember
        self.cut = False
        """Set when the drain bound cancels what is left: those requests end as the worker's failure (the gateway
        moves a started stream to a live worker) rather than as an abort."""

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._tasks))

    def get(self, request_id: str) -> asyncio.Task[None] | None:
        """The running task of `request_id`, if any."""
        return self._tasks.get(request_id)

    def remembers_abort(self, request_id: str) -> bool:
        """Has an abort for `request_id` arrived before the request itself?"""
        return request_id in self._aborted

    def spawn(self, request_id: str, run: RequestCoroutine, *, aborted: RequestCoroutine | None = None,
              name: str = "") -> asyncio.Task[None]:
        """Start `run` as the task of `request_id` (or `aborted`, when its abort came first: see module doc)."""
        if request_id in self._tasks:
            _close(run, aborted)
            raise DuplicateRequest(f"request id {request_id!r} is already running")
        if request_id in self._aborted:
            del self._aborted[request_id]
            run.close()
            run = aborted if aborted is not None else _nothing()
        elif aborted is not None:
            aborted.close()
        task = asyncio.create_task(run, name=name or f"request-{request_id}")
        self._tasks[request_id] = task
        task.add_done_callback(lambda t: self._done(request_id, t))
        return task

    def cancel(self, request_id: str) -> bool:
        """Cancel the task of `request_id`; False (and the id remembered) when there is none."""
        task = self._tasks.get(request_id)
        if task is None:
            self._aborted[request_id] = None
            self._aborted.move_to_end(request_id)
            while len(self._aborted) > self._remember:
                self._aborted.popitem(last=False)
            return False
        task.cancel()
        return True

    async def abort(self, request_id: str, timeout_s: float = 10.0) -> bool:
        """cancel(), then wait up to `timeout_s` for the task's cleanup. True when there was a task."""
        task = self._tasks.get(request_id)
        self.cancel(request_id)
        if task is None:
            return False
        await asyncio.wait({task}, timeout=timeout_s)  # the task's own exception is its business (logged)
        return True

    async def drain(self, timeout_s: float, cancel_wait_s: float = 5.0) -> int:
        """Wait up to `timeout_s` for every task, cancel what is left, wait up to `cancel_wait_s` for those.
        Returns how many were cancelled."""
        tasks = set(self._tasks.values())
        if not tasks:
            return 0
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        if not pending:
            return 0
        log.warning("cancelling requests left after the drain bound", extra={"requests": len(pending)})
        self.cut = True
        for task in pending:
            task.cancel()
        _, stuck = await asyncio.wait(pending, timeout=cancel_wait_s)
        if stuck:
            log.error("requests did not stop after cancellation", extra={"requests": len(stuck)})
        return len(pending)

    def _done(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("request task failed", exc_info=task.exception(), extra={"request": request_id})


async def _nothing() -> None:
    return None


def _close(*coros: RequestCoroutine | None) -> None:
    for coro in coros:
        if coro is not None:
            coro.close()
