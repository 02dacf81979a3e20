"""Decode role logic: reserve pages for a prompt prefill is about to compute, receive its KV while it
streams in, take over with the first token, decode, stream TokenChunks.

`DecodeWorker.prepare()` admits the request (prefix hit + reserved pages) and registers the incoming
transfer, which must match this worker's own plan; `commit()` carries prefill's first token, after which
the request decodes and streams. IO is injected (`publish`), so the code runs under NATS and in tests.
Every wait is bounded. A failure before the end aborts the engine request (freeing its pages), cancels the
transfer and publishes an error chunk; a cancelling commit frees everything and publishes nothing.
Protocol: docs/serving.md, "Request lifecycle" and "Failure semantics".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from libs.bus import Unavailable
from libs.engine import AsyncEngine
from libs.engine import disagg as dg
from libs.engine.mm import MMEmbeddings
from libs.mm.api import EncoderUnavailable
from libs.transfer import IncomingTransfer, KVTransferEngine, TransferHeader
from libs.worker.kv_stream import layer_specs
from libs.worker.mm import EmbeddingFetcher, fetch_embeddings
from libs.worker.tasks import DuplicateRequest, RequestTasks
from libs.worker.wire import engine_first_drafts, engine_params, wire_finish, wire_logprob
from protos.messages import (
    KVCommitReply,
    KVCommitRequest,
    KVPrepareReply,
    KVPrepareRequest,
    TokenChunk,
    Usage,
    WireFinishReason,
)

log = logging.getLogger("windserve.decode")
_TAKEN_KEPT = 4096  # commits remembered after their hand-off closed, so a repeated ask is answered as the first

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
    cancelled: int = 0  # reservations prefill cancelled (the first token ended the request, or prefill failed)

    def as_details(self) -> dict[str, str]:
        return {"kv_requests": str(self.requests), "kv_bytes_received": str(self.bytes_received),
                "kv_hit_tokens": str(self.hit_tokens), "kv_failures": str(self.failures),
                "kv_refused": str(self.refused), "kv_cancelled": str(self.cancelled)}


class DecodeWorker:
    """Serves kv_prepare and kv_commit. `engine` wraps a started DisaggEngineCore; `transfer` is a started
    engine. `transfer_timeout_s` bounds every pause of an incoming KV stream."""

    def __init__(self, engine: AsyncEngine, transfer: KVTransferEngine, instance_id: str, publish: Publish, *,
                 transfer_timeout_s: float = 60.0, admit_timeout_s: float = 10.0,
                 tasks: RequestTasks | None = None, fetcher: EmbeddingFetcher | None = None,
                 address: str = "") -> None:
        if not isinstance(engine.core, dg.DisaggEngineCore):
            raise TypeError("DecodeWorker needs an AsyncEngine over a DisaggEngineCore")
        self.engine = engine
        self.core: dg.DisaggEngineCore = engine.core
        self.transfer = transfer
        # the address prefill dials: the advertised one (this container's IP when the engine binds 0.0.0.0
        # under compose), not the bound one
        self.address = address or transfer.address
        self.instance_id = instance_id
        self.publish = publish
        self.transfer_timeout_s = transfer_timeout_s
        self.admit_timeout_s = admit_timeout_s
        self.stats = ReceiveStats()
        self.fetcher = fetcher  # multimodal models: the embeddings a recompute (preemption) needs
        self.tasks = tasks if tasks is not None else RequestTasks()  # the service's registry (aborts, drain)
        self._commits: dict[str, asyncio.Future[KVCommitRequest]] = {}  # open hand-offs, by request id
        # open hand-offs' kv_prepare (message, its answer, the request's task), so a repeated ask joins the first
        self._prepares: dict[str, tuple[KVPrepareRequest, asyncio.Future[KVPrepareReply], asyncio.Task[None]]] = {}
        self._taken: collections.OrderedDict[str, KVCommitRequest] = collections.OrderedDict()  # recent commits

    def _chunk(self, request_id: str, **fields) -> TokenChunk:
        return TokenChunk(request_id=request_id, instance_id=self.instance_id, **fields)

    # ------------------------------------------------------------------ entry points
    async def prepare(self, msg: KVPrepareRequest) -> KVPrepareReply:
        """Admit the request and expect its KV; returns once the transfer may start. The same kv_prepare asked
        again while its hand-off is open (the first ask or its reply was lost with a NATS node) joins the
        first: one reservation, the same answer."""
        self._check_layout(msg)
        rid = msg.request_id
        open_ = self._prepares.get(rid)
        if open_ is not None and open_[0] == msg:
            _, ready, task = open_
        else:
            loop = asyncio.get_running_loop()
            ready = loop.create_future()
            committed: asyncio.Future[KVCommitRequest] = loop.create_future()
            task = self._spawn(msg, ready, committed)
            self._commits[rid] = committed
            entry = self._prepares[rid] = (msg, ready, task)
            task.add_done_callback(lambda _: self._close_handoff(rid, entry))
        waiters: set[asyncio.Future] = {ready, task}
        await asyncio.wait(waiters, timeout=self.admit_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            try:
                return ready.result()  # raises the refusal (no room, bad layout) as the bus error reply
            except dg.DecodeFull as exc:
                raise Unavailable(str(exc)) from exc  # the prefill may try another decode worker
        task.cancel()
        raise PrepareRefused(f"request {rid!r} was not admitted within {self.admit_timeout_s}s")

    def _close_handoff(self, rid: str, entry: tuple) -> None:
        self._commits.pop(rid, None)
        if self._prepares.get(rid) is entry:
            del self._prepares[rid]

    async def commit(self, msg: KVCommitRequest) -> KVCommitReply:
        """Prefill's first token (or its cancel) for an open hand-off. A cancel returns once the request has
        ended here (its pages freed, nothing published), so the prefill's own final chunk is the last word."""
        rid = msg.request_id
        if self._taken.get(rid) == msg:  # prefill asked again: the reply to the first ask was lost
            return KVCommitReply(request_id=rid)
        committed = self._commits.get(rid)
        if committed is None or committed.done():
            raise PrepareRefused(f"no hand-off of request {rid!r} is open on this decode worker")
        committed.set_result(msg)
        self._taken[rid] = msg
        if len(self._taken) > _TAKEN_KEPT:
            self._taken.popitem(last=False)
        task = self.tasks.get(rid)
        if msg.cancel and task is not None:
            await asyncio.wait({task}, timeout=self.admit_timeout_s)
        return KVCommitReply(request_id=rid)

    async def abort(self, request_id: str) -> bool:
        return await self.tasks.abort(request_id)

    def _spawn(self, msg: KVPrepareRequest, ready: asyncio.Future[KVPrepareReply],
               committed: asyncio.Future[KVCommitRequest]) -> asyncio.Task[None]:
        """The request's task: `_run`, or `_aborted` when its abort came first; PrepareRefused when the id is
        already here."""
        try:
            return self.tasks.spawn(msg.request_id, self._run(msg, ready, committed),
                                    aborted=self._aborted(msg, ready), name=f"decode-{msg.request_id}")
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
    async def _run(self, msg: KVPrepareRequest, ready: asyncio.Future[KVPrepareReply],
                   committed: asyncio.Future[KVCommitRequest]) -> None:
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[dg.RemoteSlot] = loop.create_future()

        def on_admitted(slot: dg.RemoteSlot) -> None:  # engine thread
            loop.call_soon_threadsafe(_settle, admitted, slot)

        rid = msg.request_id
        cut = len(msg.token_ids) - msg.resumed  # the prompt, then a migrated stream's tokens already sent
        req = dg.RemoteRequest(rid, list(msg.token_ids[:cut]), engine_params(msg.sampling), on_admitted=on_admitted,
                               resumed=list(msg.token_ids[cut:]))
        outputs: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(self._pump(req, outputs), name=f"decode-pump-{rid}")
        # images: their rows are fetched while the KV streams in (a preempted request recomputes its prompt here)
        embeds = asyncio.ensure_future(fetch_embeddings(self.fetcher, msg.mm_items)) if msg.mm_items else None
        incoming: IncomingTransfer | None = None
        finished = False
        try:
            slot = await self._admitted(admitted, pump, rid)  # 1. pages reserved
            destinations, num_layers, landing = self._destinations(msg, slot)
            incoming = self.transfer.expect(rid, destinations)  # 2. transfer expected
            ready.set_result(KVPrepareReply(request_id=rid, hit_tokens=slot.hit_tokens,  # 3. prefill may start
                                            address=self.address))
            commit = await self._await_commit(incoming, committed, num_layers)  # 4. KV streams in
            if commit.cancel:
                self.stats.cancelled += 1
                return  # the cleanup below frees everything; prefill publishes the final chunk
            stats = await incoming.wait(self.transfer_timeout_s)  # 5. every layer landed
            self.stats.requests += 1
            self.stats.bytes_received += stats.nbytes
            self.stats.hit_tokens += slot.hit_tokens
            if embeds is not None:
                req.mm = await self._embeddings(embeds, msg)
            # the landed pages reach the pools (every rank's, on a parallel engine) on the engine thread first
            first = engine_first_drafts(commit)  # MTP in prefill: the first step verifies prefill's drafts
            await self.engine.call(lambda core: core.activate(rid, commit.first_token_id, landing.land, first))
            await self.publish(msg.stream_subject, self._chunk(
                rid, token_ids=[commit.first_token_id],
                logprobs=[] if commit.first_logprob is None else [commit.first_logprob]))
            finished = await self._stream(msg, commit, outputs, pump)  # 6.
        except asyncio.CancelledError:  # an abort; past the drain bound, the worker's failure (the stream moves)
            await self._final_error(msg, f"decode worker {self.instance_id} stopped (drain bound reached)"
                                    if self.tasks.cut else None, cut=self.tasks.cut)
            raise
        except Exception as exc:
            if isinstance(exc, dg.DecodeFull):
                self.stats.refused += 1
                log.info("decode refused: full", extra={"request": rid, "error": str(exc)})
            else:
                self.stats.failures += 1
                log.warning("decode failed", extra={"request": rid, "error": str(exc)})
            if not ready.done():
                ready.set_exception(exc)
            else:
                await self._final_error(msg, f"decode: {exc}")
        finally:
            if embeds is not None:
                embeds.cancel()
                if embeds.done() and not embeds.cancelled():
                    embeds.exception()  # retrieved: a fetch that failed after the request ended is no news
            if not finished:
                pump.cancel()  # leaving engine.generate() aborts the request: its pages are freed
                with contextlib.suppress(BaseException):
                    async with asyncio.timeout(10):
                        await pump
                if incoming is not None:
                    with contextlib.suppress(Exception):
                        await incoming.cancel("decode request ended")

    async def _embeddings(self, embeds: asyncio.Future, msg: KVPrepareRequest) -> MMEmbeddings:
        """The fetched rows (the fetch is bounded by the fetcher), checked against the prompt before the sequence
        may run; a failed fetch fails the request here, explicitly, rather than later at a recompute."""
        try:
            mm = await embeds
        except EncoderUnavailable as exc:
            raise RuntimeError(f"the image embeddings a recompute would need could not be fetched: {exc}") from exc
        assert mm is not None
        mm.check(msg.token_ids, self.core.model_config.hidden_size)
        return mm

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
        """The transfer's destinations (a header check returning where this worker's plan lands: its pool pages,
        or a parallel engine's staging), the number of layer payloads in that plan, and its Landing. The header
        and bytes hold every KV head whatever tp either side runs, so a prefill of another tp matches."""
        core = self.core
        plan = dg.plan_stream(len(msg.token_ids), core.config.page_size, core.cache.cfg.window, slot.hit_tokens,
                              msg.segment_pages)
        kv, layer_is_swa = core.runner.kv_access(), core.kv_layer_is_swa
        specs = tuple(layer_specs(dg.stream_specs(kv.shapes, layer_is_swa, plan)))
        landing = kv.receive(dg.stream_layers(layer_is_swa, plan, slot.full_table, slot.swa_table))

        def check(header: TransferHeader):  # the sender's plan must be ours, or bytes would land in the wrong pages
            if tuple(header.layers) != specs:
                raise ValueError(f"request {msg.request_id}: header layers differ from the decode plan")
            return landing.payloads

        return check, len(specs), landing

    async def _await_commit(self, incoming: IncomingTransfer, committed: asyncio.Future[KVCommitRequest],
                            num_layers: int) -> KVCommitRequest:
        """Prefill's kv_commit, which comes once its prompt is computed (and normally after the last layer).
        Until then every layer must land within transfer_timeout_s of the previous one (the first: of the
        prepare), and the commit within transfer_timeout_s of the last layer; a failed transfer raises at once."""
        for position in range(num_layers):
            layer = asyncio.ensure_future(incoming.layer(position, self.transfer_timeout_s))
            waiters: set[asyncio.Future] = {layer, committed}
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                layer.cancel()  # (the transfer's own future is shielded: only this wait ends)
            if committed.done():
                return committed.result()
            layer.result()  # raises the transfer's failure (or its timeout, which cancelled it)
        async with asyncio.timeout(self.transfer_timeout_s):
            return await asyncio.shield(committed)

    async def _pump(self, req: dg.RemoteRequest, outputs: asyncio.Queue) -> None:
        async for out in self.engine.generate(req):
            outputs.put_nowait(out)

    async def _stream(self, msg: KVPrepareRequest, commit: KVCommitRequest, outputs: asyncio.Queue,
                      pump: asyncio.Task) -> bool:
        """Publish engine outputs until the finished one; True when the request finished normally."""
        completion = 1 + msg.resumed  # (usage counts the whole answer)
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
                usage = Usage(prompt_tokens=len(msg.token_ids) - msg.resumed, completion_tokens=completion,
                              cached_tokens=commit.prefill_cached_tokens)
            await self.publish(msg.stream_subject, self._chunk(
                msg.request_id, token_ids=list(out.new_token_ids),
                logprobs=[wire_logprob(lp) for lp in out.logprobs or ()],
                finish_reason=wire_finish(out.finish_reason), usage=usage))
            if out.finished:
                return out.finish_reason is not dg.FinishReason.ABORT

    async def _final_error(self, msg: KVPrepareRequest, error: str | None, cut: bool = False) -> None:
        chunk = (self._chunk(msg.request_id, finish_reason=WireFinishReason.ABORT) if error is None else
                 self._chunk(msg.request_id, finish_reason=WireFinishReason.ERROR, error=error,
                             instance_failed=cut or not self.engine.is_running))  # engine died or stuck: gone
        try:
            async with asyncio.timeout(5):
                await self.publish(msg.stream_subject, chunk)
        except Exception as exc:
            log.warning("could not publish final chunk", extra={"request": msg.request_id, "error": repr(exc)})
