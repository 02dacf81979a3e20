"""The service side of the KV hand-off shared by prefill and decode: engine payload specs as transfer
LayerSpecs, and prefill's outgoing stream (`KVSender`), which sends the segments the engine thread copies
out (libs/engine/disagg `SegmentCollector`) while the prefill goes on computing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from libs.engine import disagg as dg
from libs.model.paged import KVPools
from libs.transfer import LayerSpec, OutgoingTransfer, TransferStats


def layer_specs(specs: Sequence[dg.PayloadSpec]) -> list[LayerSpec]:
    """The transfer header's layers for the engine's payload specs (same fields, same order)."""
    return [LayerSpec(*spec) for spec in specs]


class KVSender:
    """One request's outgoing KV transfer, fed segment by segment from the engine thread.

    `collector` is the engine's progress hook (give it to the prefill Request); the segments it copies out of
    `kv` (the engine's `runner.kv_access()`; a KVPools stands for its plain one) are queued on this event loop
    and sent in plan order by a background task, each `send_layer` bounded by `layer_timeout_s`. `finish()`
    waits (bounded) for the last segment, ends the transfer and returns when decode has every byte; `abort()`
    stops it at any point.
    """

    def __init__(self, tx: OutgoingTransfer, address: str, kv: dg.KVAccess | KVPools,
                 layer_is_swa: Sequence[bool], plan: dg.StreamPlan, layer_timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self.tx = tx
        self.address = address
        self.layer_timeout_s = layer_timeout_s
        self.send_seconds = 0.0  # time spent in send_layer / finish (the transfer's own share of the request)
        self._queue: asyncio.Queue[list[dg.Payload] | BaseException] = asyncio.Queue()

        def deliver(item: list[dg.Payload] | BaseException) -> None:  # engine thread
            loop.call_soon_threadsafe(self._queue.put_nowait, item)

        self.collector = dg.SegmentCollector(kv, layer_is_swa, plan, deliver)
        self.task = asyncio.create_task(self._pump(len(plan.segments)), name=f"kv-send-{tx.request_id}")
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by run(), not here

    async def _pump(self, segments: int) -> None:
        for _ in range(segments):
            item = await self._queue.get()  # the engine's pace; run() bounds the prefill itself
            if isinstance(item, BaseException):
                raise item
            for payload in item:
                start = time.perf_counter()
                async with asyncio.timeout(self.layer_timeout_s):
                    await self.tx.send_layer(payload)
                self.send_seconds += time.perf_counter() - start

    async def finish(self, timeout_s: float) -> TransferStats:
        """Every segment sent (the engine has delivered them all by the time the prefill finished), END sent,
        DONE received: the bytes are in decode's pages."""
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(self.task)
            start = time.perf_counter()
            stats = await self.tx.finish(timeout_s)
        self.send_seconds += time.perf_counter() - start
        return stats

    async def abort(self, reason: str) -> None:
        """Stop sending (a no-op once finished or failed); decode's transfer fails at once."""
        self.task.cancel()
        await asyncio.wait({self.task}, timeout=self.layer_timeout_s)  # a send in flight ends first
        with contextlib.suppress(Exception):
            await self.tx.abort(reason)
