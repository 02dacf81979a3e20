"""Dynamic batching of the vision tower: one tower call per batch, on a dedicated thread.

`DynamicBatcher` takes queued items into a batch until `max_items` or `max_patches` is reached or
`max_wait_s` has passed since the first (an item larger than `max_patches` runs alone). It waits only when
another item is expected before the wait ends (an average of recent arrival gaps), so a lone item runs at
once and an idle encoder adds at most `max_wait_s` to a request; the next batch forms while the tower runs
one. The tower gets each batch in one call and the rows come back split per item, contiguous on the host.
Details: docs/multimodal.md, "Encoder service".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from libs.mm.placeholders import num_tokens
from libs.model.vision_config import VisionConfig

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(patches ``[sum patches, patch_dim]``, grid_thw ``[items, 3]``) -> rows ``[sum tokens, hidden]``."""
OnBatch = Callable[[int, int, float], None]
"""(items, patches, seconds of the tower call): metrics."""
GAP_WEIGHT = 0.25  # of the newest gap between arrivals in their running average
GAP_CAP = 4.0  # a gap counts at most this many max_wait_s (an idle minute must not hide the next burst)


@dataclass
class _Job:
    patches: torch.Tensor
    grid: tuple[int, int, int]
    future: asyncio.Future[torch.Tensor] = field(repr=False)

    @property
    def size(self) -> int:
        return int(self.patches.shape[0])


def fits(items: int, patches: int, job_patches: int, max_items: int, max_patches: int) -> bool:
    """Whether a job of `job_patches` joins a batch of `items` items / `patches` patches (pure). The first job of
    a batch always does, whatever its size."""
    return items == 0 or (items < max_items and patches + job_patches <= max_patches)


def next_gap(average: float, gap: float, max_wait_s: float) -> float:
    """The running average of arrival gaps after one more `gap` (pure)."""
    return average + GAP_WEIGHT * (min(gap, GAP_CAP * max_wait_s) - average)


def worth_waiting(last_arrival: float | None, gap_s: float, deadline: float) -> bool:
    """Whether the next item is expected by `deadline` (loop time), going by the last arrival and the average gap
    (pure)."""
    return last_arrival is None or last_arrival + gap_s <= deadline


class DynamicBatcher:
    def __init__(self, forward: Forward, vc: VisionConfig, max_items: int, max_patches: int, max_wait_s: float,
                 on_batch: OnBatch | None = None) -> None:
        if max_items < 1 or max_patches < 1 or max_wait_s < 0:
            raise ValueError(f"bad batch limits: {max_items=} {max_patches=} {max_wait_s=}")
        self.forward, self.vc = forward, vc
        self.max_items, self.max_patches, self.max_wait_s = max_items, max_patches, max_wait_s
        self.on_batch = on_batch
        self._queue: deque[_Job] = deque()
        self._wake = asyncio.Event()
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder-tower")
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        self.items = 0
        self.gap_s = 0.0  # running average of the gaps between arrivals (0 until measured: wait, as before)
        self._last_arrival: float | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="encoder-batcher")

    async def close(self) -> None:
        """Stop the loop; queued items fail (RuntimeError), a running tower call finishes on its thread."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(RuntimeError("encoder shutting down"))
        self._thread.shutdown(wait=False, cancel_futures=True)

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The item's rows ``[num_tokens, hidden]`` (host, contiguous) once its batch ran."""
        if self._task is None:
            raise RuntimeError("batcher not started")
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._last_arrival is not None:
            self.gap_s = next_gap(self.gap_s, now - self._last_arrival, self.max_wait_s)
        self._last_arrival = now
        job = _Job(patches, grid, loop.create_future())
        self._queue.append(job)
        self._wake.set()
        return await job.future

    async def _next_job(self, deadline: float | None) -> _Job | None:
        """The next live job (a cancelled caller's is dropped); None once `deadline` (loop time) has passed."""
        loop = asyncio.get_running_loop()
        while True:
            while self._queue:
                job = self._queue.popleft()
                if not job.future.done():
                    return job
            self._wake.clear()
            if deadline is None:
                await self._wake.wait()
                continue
            left = deadline - loop.time()
            if left <= 0:
                return None
            try:
                async with asyncio.timeout(left):
                    await self._wake.wait()
            except TimeoutError:
                return None

    async def _collect(self) -> list[_Job]:
        first = await self._next_job(None)
        assert first is not None
        batch, patches = [first], first.size
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while len(batch) < self.max_items:
            if not self._queue and not worth_waiting(self._last_arrival, self.gap_s, deadline):
                break  # no item is expected within the wait: run now
            job = await self._next_job(deadline)
            if job is None:
                break
            if not fits(len(batch), patches, job.size, self.max_items, self.max_patches):
                self._queue.appendleft(job)  # starts the next batch
                break
            batch.append(job)
            patches += job.size
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            started = time.perf_counter()
            try:
                rows = await loop.run_in_executor(self._thread, self._run, [j.patches for j in batch],
                                                  [j.grid for j in batch])
            except Exception as exc:  # the tower failed: every item of the batch fails with it
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            self.batches += 1
            self.items += len(batch)
            if self.on_batch is not None:
                self.on_batch(len(batch), sum(j.size for j in batch), time.perf_counter() - started)
            for job, out in zip(batch, rows, strict=True):
                if not job.future.done():
                    job.future.set_result(out)

    def _run(self, patches: Sequence[torch.Tensor], grids: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        """On the tower thread: one call for the batch, rows split per item and moved to the host."""
        x = patches[0] if len(patches) == 1 else torch.cat(list(patches))
        grid = torch.tensor(list(grids), dtype=torch.int64, device=x.device)
        out = self.forward(x, grid)
        sizes = [num_tokens(g, self.vc) for g in grids]
        if out.shape[0] != sum(sizes):
            raise RuntimeError(f"tower returned {out.shape[0]} rows for {sum(sizes)} tokens of {len(grids)} items")
        return [r.detach().to("cpu").contiguous() for r in torch.split(out, sizes)]
