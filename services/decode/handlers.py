"""Decode role logic: admit a shipped request, receive its KV, decode, stream TokenChunks.

IO is injected (`publish`), so the same code runs under NATS in the service and in-process in tests.

One request (`prepare()` answers the prefill worker after step 2; the rest runs in the background):
  1. admit into both pools through the engine thread (prefix hit on this worker + pages for the rest);
  2. register the incoming transfer with the reserved pool pages as destinations;
  3. publish the first token (sampled by prefill) at once;
  4. wait (bounded) for every layer to land, then activate: the sequence joins the running batch;
  5. stream one chunk per engine output; the engine caches the finished sequence (prompt + output),
     so a follow-up turn sent here hits and needs fewer pages shipped.
Any failure before the end -> the engine request is aborted (frees its pages), the incoming transfer is
cancelled (the sender stops), an error chunk is published.
Each request is one task of the engine-worker base's registry (libs/worker/tasks.py): an abort cancels it,
an abort that arrived before kv_prepare means nothing is admitted (the stream gets the abort chunk and
kv_prepare is refused), and a draining service cancels what is left after its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from libs.bus import Unavailable
from libs.engine import AsyncEngine
from libs.engine import disagg as dg
from libs.transfer import IncomingTransfer, KVTransferEngine
from libs.worker.tasks import DuplicateRequest, RequestTasks
from libs.worker.wire import engine_params, wire_finish, wire_logprob
from protos.messages import FinishReason, KVPrepareReply, KVPrepareRequest, TokenChunk, Usage

log = logging.getLogger("windserve.decode")

Publish = Callable[[str, TokenChunk], Awaitable[None]]


def _settle(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


class PrepareRefused(RuntimeError):
    """kv_prepare cannot be honoured (mismatched layout, no room, duplicate id); the message says why."""


@dataclass
class ReceiveStats:
    requests: int = 0
    bytes_received: int = 0
    hit_tokens: int = 0
    failures: int = 0
    refused: int = 0  # kv_prepare answered "full" (the prefill tries another decode worker)

    def as_details(self) -> dict[str, str]:
        return {"kv_requests": str(self.requests), "kv_bytes_received": str(self.bytes_received),
                "kv_hit_tokens": str(self.hit_tokens), "kv_failures": str(self.failures),
                "kv_refused": str(self.refused)}


class DecodeWorker:
    """Serves kv_prepare. `engine` wraps a started DisaggEngineCore; `transfer` is a started engine."""

    def __init__(self, engine: AsyncEngine, transfer: KVTransferEngine, instance_id: str, publish: Publish, *,
                 transfer_timeout_s: float = 60.0, admit_timeout_s: float = 10.0,
                 tasks: RequestTasks | None = None) -> None:
        if not isinstance(engine.core, dg.DisaggEngineCore):
            raise TypeError("DecodeWorker needs an AsyncEngine over a DisaggEngineCore")
        self.engine = engine
        self.core: dg.DisaggEngineCore = engine.core
        self.transfer = transfer
        self.instance_id = instance_id
        self.publish = publish
        self.transfer_timeout_s = transfer_timeout_s
        self.admit_timeout_s = admit_timeout_s
        self.stats = ReceiveStats()
        self.tasks = tasks if tasks is not None else RequestTasks()  # the service's registry (aborts, drain)

    def _chunk(self, request_id: str, **fields) -> TokenChunk:
        return TokenChunk(request_id=request_id, instance_id=self.instance_id, **fields)

    # ------------------------------------------------------------------ entry points
    async def prepare(self, msg: KVPrepareRequest) -> KVPrepareReply:
        """Admit the request and expect its KV; returns once the transfer may start."""
        self._check_layout(msg)
        ready: asyncio.Future[KVPrepareReply] = asyncio.get_running_loop().create_future()
        task = self._spawn(msg, ready)
        waiters: set[asyncio.Future] = {ready, task}
        await asyncio.wait(waiters, timeout=self.admit_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            try:
                return ready.result()  # raises the refusal (no room, bad layout) as the bus error reply
            except dg.DecodeFull as exc:
                raise Unavailable(str(exc)) from exc  # the prefill may try another decode worker
        task.cancel()
        raise PrepareRefused(f"request {msg.request_id!r} was not admitted within {self.admit_timeout_s}s")

    async def abort(self, request_id: str) -> bool:
        return await self.tasks.abort(request_id)

    def _spawn(self, msg: KVPrepareRequest, ready: asyncio.Future[KVPrepareReply]) -> asyncio.Task[None]:
        """The request's task: `_run`, or `_aborted` when its abort came first; PrepareRefused when the id is
        already here."""
        try:
            return self.tasks.spawn(msg.request_id, self._run(msg, ready), aborted=self._aborted(msg, ready),
                                    name=f"decode-{msg.request_id}")
        except DuplicateRequest:
            raise PrepareRefused(f"request {msg.request_id!r} is already on this decode worker") from None

    async def _aborted(self, msg: KVPrepareRequest, ready: asyncio.Future[KVPrepareReply]) -> None:
        """The task of a request whose abort arrived first: nothing is admitted; the stream gets the abort
        chunk before kv_prepare is refused (so it is the client's first final chunk)."""
        await self._final_error(msg, None)
        if not ready.done():
            ready.set_exception(PrepareRefused(f"request {msg.request_id!r} was aborted before it reached "
                                               f"decode {self.instance_id}"))

    def _check_layout(self, msg: KVPrepareRequest) -> None:
        cfg = self.core.config
        if msg.page_size != cfg.page_size or msg.kv_dtype != cfg.dtype:
            raise PrepareRefused(f"KV layout mismatch: prefill sends page_size {msg.page_size} / {msg.kv_dtype}, "
                                 f"this decode worker uses {cfg.page_size} / {cfg.dtype}")

    # ------------------------------------------------------------------ one request
    async def _run(self, msg: KVPrepareRequest, ready: asyncio.Future[KVPrepareReply]) -> None:
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[dg.RemoteSlot] = loop.create_future()

        def on_admitted(slot: dg.RemoteSlot) -> None:  # engine thread
            loop.call_soon_threadsafe(_settle, admitted, slot)

        req = dg.RemoteRequest(msg.request_id, list(msg.token_ids), engine_params(msg.sampling),
                               first_token=msg.first_token_id, on_admitted=on_admitted)
        outputs: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(self._pump(req, outputs), name=f"decode-pump-{msg.request_id}")
        incoming: IncomingTransfer | None = None
        finished = False
        try:
            slot = await self._admitted(admitted, pump, msg.request_id)
            incoming = self.transfer.expect(msg.request_id, self._destinations(msg, slot))
            ready.set_result(KVPrepareReply(request_id=msg.request_id, hit_tokens=slot.hit_tokens,
                                            address=self.transfer.address))
            await self.publish(msg.stream_subject, self._chunk(
                msg.request_id, token_ids=[msg.first_token_id],
                logprobs=[] if msg.first_logprob is None else [msg.first_logprob]))
            stats = await incoming.wait(self.transfer_timeout_s)
            self.stats.requests += 1
            self.stats.bytes_received += stats.nbytes
            self.stats.hit_tokens += slot.hit_tokens
            await self.engine.call(lambda core: core.activate(msg.request_id))
            finished = await self._stream(msg, outputs, pump)
        except asyncio.CancelledError:
            await self._final_error(msg, None)
            raise
        except Exception as exc:
            if isinstance(exc, dg.DecodeFull):
                self.stats.refused += 1
                log.info("decode refused: full", extra={"request": msg.request_id, "error": str(exc)})
            else:
                self.stats.failures += 1
                log.warning("decode failed", extra={"request": msg.request_id, "error": str(exc)})
            if not ready.done():
                ready.set_exception(exc)
            else:
                await self._final_error(msg, f"decode: {exc}")
        finally:
            if not finished:
                pump.cancel()  # leaving engine.generate() aborts the request: its pages are freed
                with contextlib.suppress(BaseException):
                    async with asyncio.timeout(10):
                        await pump
                if incoming is not None:
                    with contextlib.suppress(Exception):
                        await incoming.cancel("decode request ended")

    async def _admitted(self, admitted: asyncio.Future, pump: asyncio.Task, request_id: str) -> dg.RemoteSlot:
        done, _ = await asyncio.wait({admitted, pump}, timeout=self.admit_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if admitted in done:
            return admitted.result()
        if pump in done:
            pump.result()  # raises the engine's refusal (no room, duplicate id)
            raise PrepareRefused(f"request {request_id!r} finished before admission")
        raise PrepareRefused(f"engine did not admit {request_id!r} within {self.admit_timeout_s}s")

    def _destinations(self, msg: KVPrepareRequest, slot: dg.RemoteSlot):
        core = self.core
        plan = dg.plan_shipment(len(msg.token_ids), core.config.page_size, core.cache.cfg.window, slot.hit_tokens)
        layers = dg.shipment_layers(core.model_config.layer_is_swa, plan, slot.full_table, slot.swa_table)
        kv = core.runner.kv
        specs = dg.layer_specs(kv, layers)
        dests = [dg.destination_views(kv, lp) for lp in layers]

        def check(header):  # the sender's plan must be ours, or bytes would land in the wrong pages
            if tuple(header.layers) != tuple(specs):
                raise ValueError(f"request {msg.request_id}: header layers differ from the decode plan")
            return dests

        return check

    async def _pump(self, req: dg.RemoteRequest, outputs: asyncio.Queue) -> None:
        async for out in self.engine.generate(req):
            outputs.put_nowait(out)

    async def _stream(self, msg: KVPrepareRequest, outputs: asyncio.Queue, pump: asyncio.Task) -> bool:
        """Publish engine outputs until the finished one; True when the request finished normally."""
        completion = 1
        while True:
            getter = asyncio.ensure_future(outputs.get())
            done, _ = await asyncio.wait({getter, pump}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                pump.result()  # engine died: raises
                if outputs.empty():
                    raise RuntimeError("engine stream ended without a final output")
                continue
            out = getter.result()
            completion += len(out.new_token_ids)
            usage = None
            if out.finished:
                usage = Usage(prompt_tokens=len(msg.token_ids), completion_tokens=completion,
                              cached_tokens=msg.prefill_cached_tokens)
            await self.publish(msg.stream_subject, self._chunk(
                msg.request_id, token_ids=list(out.new_token_ids),
                logprobs=[wire_logprob(lp) for lp in out.logprobs or ()],
                finish_reason=wire_finish(out.finish_reason), usage=usage))
            if out.finished:
                return out.finish_reason is not dg.FinishReason.ABORT

    async def _final_error(self, msg: KVPrepareRequest, error: str | None) -> None:
        chunk = (self._chunk(msg.request_id, finish_reason=FinishReason.ABORT) if error is None else
                 self._chunk(msg.request_id, finish_reason=FinishReason.ERROR, error=error))
        try:
            async with asyncio.timeout(5):
                await self.publish(msg.stream_subject, chunk)
        except Exception as exc:
            log.warning("could not publish final chunk", extra={"request": msg.request_id, "error": repr(exc)})
