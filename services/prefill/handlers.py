"""Prefill role logic: reserve on a decode worker, prefill while the KV streams there, hand over the first token.

`PrefillWorker.run()` fetches image embeddings, reserves pages on the routed decode worker before any
compute, sends each segment of the streamed plan once computed, then publishes the first token itself when
it ends the request, or waits until every byte landed and hands it to decode, which owns the stream from
there. IO is injected (`prepare`, `commit`, `publish`), so the code runs under NATS and in tests. Every
wait is bounded; a failure publishes an error chunk, then cancels the decode reservation; the held KV is
always released into the prefix cache. Protocol: docs/serving.md, "Request lifecycle".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from libs.bus import NoResponders, RemoteError, Unavailable
from libs.engine import AsyncEngine, Request, RequestOutput
from libs.engine import disagg as dg
from libs.engine.mm import MMEmbeddings
from libs.engine.mtp import FirstDrafts
from libs.mm.api import EncoderUnavailable
from libs.transfer import KVTransferEngine, TransferStats
from libs.worker.kv_stream import KVSender, layer_specs
from libs.worker.mm import EmbeddingFetcher, fetch_embeddings
from libs.worker.tasks import RequestTasks
from libs.worker.wire import engine_params, wire_finish, wire_hidden, wire_logprob
from protos.messages import (
    AckStatus,
    ErrorCode,
    GenerateRequest,
    KVCommitReply,
    KVCommitRequest,
    KVPrepareReply,
    KVPrepareRequest,
    TokenChunk,
    Usage,
    WireFinishReason,
    WireTokenLogprob,
)

log = logging.getLogger("windserve.prefill")
T = TypeVar("T")
COMMIT_ATTEMPT_S = 2.5  # a kv_prepare / kv_commit unanswered this long is asked again (within prepare_timeout_s)
REASK_PAUSE_S = 0.1  # between two kv_prepares of a listed decode worker that had no responders (unreachable_grace_s)

Prepare = Callable[[str, KVPrepareRequest], Awaitable[KVPrepareReply]]
Commit = Callable[[str, KVCommitRequest], Awaitable[KVCommitReply]]
Publish = Callable[[str, TokenChunk], Awaitable[None]]
# (request id, prompt tokens, decode workers that refused it) -> another decode worker's instance id
Reroute = Callable[[str, list[int], list[str]], Awaitable[str]]  # (request id, prompt token ids, refused) -> decode


def refusal(req: GenerateRequest) -> tuple[AckStatus, str] | None:
    """Why a prefill worker cannot serve `req` whatever its model (pure); the engine-worker base checks the
    rest (tokens, size, draining, duplicate ids)."""
    if req.token_ids and not req.decode_instance:
        return AckStatus.INVALID, "a prefill worker needs decode_instance (route through the router)"
    return None


def kv_tokens(req: GenerateRequest) -> list[int]:
    """The tokens whose KV prefill computes and ships: the prompt, then a migrated stream's tokens already sent."""
    return [*req.token_ids, *req.resume_token_ids]


@dataclass
class HandoffStats:
    """Totals over every shipped request (bytes are KV payload bytes)."""

    requests: int = 0
    bytes_sent: int = 0
    full_equivalent_bytes: int = 0
    transfer_seconds: float = 0.0  # time spent sending (send_layer / finish), overlapped with the prefill
    failures: int = 0
    rerouted: int = 0  # hand-offs sent to another decode worker after one answered "full" or was gone
    reasked: int = 0  # kv_prepares (no other decode worker found) and kv_commits sent again after no responders
    waited: int = 0  # requests that waited for decode room (every decode worker full when they came)

    def as_details(self) -> dict[str, str]:
        return {"kv_requests": str(self.requests), "kv_bytes_sent": str(self.bytes_sent),
                "kv_full_equivalent_bytes": str(self.full_equivalent_bytes),
                "kv_transfer_seconds": f"{self.transfer_seconds:.6f}", "kv_failures": str(self.failures),
                "kv_rerouted": str(self.rerouted), "kv_reasked": str(self.reasked), "kv_waited": str(self.waited)}


class HandoffError(RuntimeError):
    """The KV hand-off to decode failed; the message says at which step."""


class DecodeSilent(HandoffError):
    """The decode worker did not answer kv_prepare in time (it, or the NATS node it sits behind, hangs): nothing
    was computed, so the client gets a retryable 503 (`decode_unreachable`), never a 500."""


class DecodesFull(HandoffError):
    """Every decode worker tried had no room for the request (or none other was found): retry later."""


@dataclass
class _Handoff:
    """What one request holds on the way; `PrefillWorker._clean_up` gives back whatever is left."""

    decode: str = ""  # the decode worker holding a reservation for it
    sender: KVSender | None = None  # the open transfer to that worker
    held: bool = False  # this engine holds the prompt's KV (prefill-only request done, not released)
    committed: bool = False  # decode took the first token: it owns the request and its stream


First = tuple[int, WireTokenLogprob | None, int]  # first token, its logprob (wire form), prompt tokens cached here


class PrefillWorker:
    """Runs GenerateRequests in the prefill role. `transfer` is a started libs.transfer engine.

    segment_pages: full-layer pages per streamed KV segment (None: one engine step's worth,
    max_num_batched_tokens // page_size; 0: one segment, sent once the whole prompt is computed).
    decode_wait_s / decode_wait_queue: a request that every decode worker refuses as full waits up to
    decode_wait_s for room (before any compute), at most decode_wait_queue requests at once (0 s: no wait)."""

    def __init__(self, engine: AsyncEngine, transfer: KVTransferEngine, instance_id: str, prepare: Prepare,
                 publish: Publish, *, commit: Commit, prepare_timeout_s: float = 10.0,
                 transfer_timeout_s: float = 60.0, reroute: Reroute | None = None, decode_attempts: int = 3,
                 segment_pages: int | None = None, tasks: RequestTasks | None = None, decode_wait_s: float = 0.0,
                 decode_wait_queue: int = 64, fetcher: EmbeddingFetcher | None = None,
                 unreachable_grace_s: float = 1.5) -> None:
        self.engine = engine
        self.transfer = transfer
        self.instance_id = instance_id
        self.prepare = prepare
        self.commit = commit
        self.publish = publish
        self.prepare_timeout_s = prepare_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.reroute = reroute
        self.decode_attempts = decode_attempts
        self.decode_wait_s = decode_wait_s
        self.decode_wait_queue = decode_wait_queue
        self.unreachable_grace_s = unreachable_grace_s
        # one future per request waiting for decode room, oldest first; the oldest's is set: its turn to retry
        self._room_queue: deque[asyncio.Future[None]] = deque()
        self.fetcher = fetcher  # multimodal models: image embeddings, fetched before the decode reservation
        cfg = engine.core.config
        if segment_pages is None:
            segment_pages = max(1, cfg.scheduler.max_num_batched_tokens // cfg.page_size)
        self.segment_pages = segment_pages
        self.stats = HandoffStats()
        self.tasks = tasks if tasks is not None else RequestTasks()  # the service's registry (aborts, drain)

    def _chunk(self, request_id: str, **fields) -> TokenChunk:
        return TokenChunk(request_id=request_id, instance_id=self.instance_id, **fields)

    # ------------------------------------------------------------------ entry points
    def submit(self, req: GenerateRequest) -> asyncio.Task[None]:
        """Start the request in the background (the bus handler answers GenerateAccepted at once). Raises
        DuplicateRequest (a ValueError) when the id is running; when its abort came first it never runs and
        its stream gets the abort chunk."""
        if not req.decode_instance:
            raise ValueError(f"request {req.request_id!r}: a prefill worker needs decode_instance")
        abort_chunk = self._chunk(req.request_id, finish_reason=WireFinishReason.ABORT)
        return self.tasks.spawn(req.request_id, self.run(req), aborted=self._safe_publish(req, abort_chunk),
                                name=f"prefill-{req.request_id}")

    async def abort(self, request_id: str) -> bool:
        """Client went away: stop computing / sending; run()'s cleanup frees the rest."""
        return await self.tasks.abort(request_id)

    async def run(self, req: GenerateRequest) -> None:
        """The whole lifecycle of one request (module doc); never raises (errors go to the stream)."""
        h = _Handoff()
        try:
            mm = await fetch_embeddings(self.fetcher, req.mm_items)  # 0. images: their rows, before any KV
            h.decode, reply = await self._reserve_decode(req)  # 1. decode reserves pages (waits for room)
            h.sender = await self._open_stream(req, reply)  # 2. the transfer, its header = the whole plan
            first = await self._prefill(req, h, mm)  # 3. compute; segments leave as they are done
            if first is None:
                return  # the engine ended the request (its final chunk is out)
            token, logprob, cached = first
            reason, drafts = await self._settle(req, token)  # 4. does the first token end it? (KV released)
            h.held = False
            if reason is not None:
                await self._publish_final(req, token, logprob, reason, cached)
                return
            stats = await self._finish_stream(h)  # 5. every byte landed on decode,
            await self._commit(req, h.decode, first, drafts)  # then decode takes the stream over
            h.committed = True
            self._count(req, h.sender, stats)
        except asyncio.CancelledError:
            await self._safe_publish(req, self._chunk(req.request_id, finish_reason=WireFinishReason.ABORT))
            raise
        except Exception as exc:
            self.stats.failures += 1
            log.warning("prefill failed", extra={"request": req.request_id, "error": str(exc)})
            error = f"prefill {self.instance_id}: {exc}"
            await self._safe_publish(req, self._chunk(
                req.request_id, finish_reason=WireFinishReason.ERROR, error=error,
                retryable=isinstance(exc, DecodesFull | EncoderUnavailable | DecodeSilent),
                instance_failed=not self.engine.is_running,  # its engine died (or is stuck): this prefill is gone
                error_code="encoder_unavailable" if isinstance(exc, EncoderUnavailable) else
                "decode_unreachable" if isinstance(exc, DecodeSilent) else ""))
        finally:
            await self._clean_up(req.request_id, h)  # 6.

    # ------------------------------------------------------------------ 1. decode reservation
    async def _reserve_decode(self, req: GenerateRequest) -> tuple[str, KVPrepareReply]:
        """`_prepare_decode`, and when every decode worker tried is full: wait (bounded, before any compute) and
        try again on the router's current pick, up to decode_wait_s, with at most decode_wait_queue requests
        waiting at once; then DecodesFull (the client's 503 + Retry-After).

        Waiters are served first come, first served: only the oldest one retries, the next one tries as soon as
        it is served or gives up, and a request that arrives while others wait queues behind them instead of
        trying first (room that frees goes to the request that has waited longest)."""
        last: DecodesFull | None = None
        if not self._room_queue:
            try:
                return await self._prepare_decode(req, req.decode_instance)
            except DecodesFull as exc:
                if self.decode_wait_s <= 0:
                    raise
                last = exc
        if len(self._room_queue) >= self.decode_wait_queue:
            why = last or "every decode worker was full"
            raise DecodesFull(f"{why}; {len(self._room_queue)} requests already wait for decode room (the limit)")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._room_queue.append(turn)
        self._pass_turn()
        self.stats.waited += 1
        deadline = time.monotonic() + self.decode_wait_s
        try:
            return await self._wait_for_room(req, turn, deadline, last)
        finally:
            self._room_queue.remove(turn)
            self._pass_turn()

    @property
    def waiting(self) -> int:
        """Requests waiting for decode room now."""
        return len(self._room_queue)

    def _pass_turn(self) -> None:
        """Wake the oldest waiter (it may retry now)."""
        if self._room_queue and not self._room_queue[0].done():
            self._room_queue[0].set_result(None)

    async def _wait_for_room(self, req: GenerateRequest, turn: asyncio.Future[None], deadline: float,
                             last: DecodesFull | None) -> tuple[str, KVPrepareReply]:
        """Wait for this request's turn, then retry with backoff until a decode worker takes it or the deadline."""
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await turn
        except TimeoutError:
            raise DecodesFull(f"no decode worker had room within {self.decode_wait_s}s: it waited in line behind "
                              f"older requests ({last or 'every decode worker was full'})") from None
        delay = 0.05
        # a request that came in behind others tries as soon as its turn comes (the one before it just got room or
        # gave up); one that has just been refused waits first
        pause = last is not None
        while (remaining := deadline - time.monotonic()) > 0:
            if pause:
                # between attempts, never around one: a kv_prepare cut short could leave pages reserved
                await asyncio.sleep(min(delay, remaining))
                delay = min(2 * delay, 0.5)
            pause = True
            try:
                return await self._prepare_decode(req, await self._current_decode(req))
            except DecodesFull as exc:
                last = exc
        raise DecodesFull(f"no decode worker had room within {self.decode_wait_s}s: {last}")

    async def _current_decode(self, req: GenerateRequest) -> str:
        """The router's pick for the request now (the routed one when the router cannot say)."""
        if self.reroute is not None:
            with contextlib.suppress(Exception):
                return await self.reroute(req.request_id, kv_tokens(req), [])
        return req.decode_instance

    async def _prepare_decode(self, req: GenerateRequest, decode: str) -> tuple[str, KVPrepareReply]:
        """kv_prepare on `decode`; when it answers "full" (UNAVAILABLE) or is gone (no responders: it died and
        the registry still lists it), ask the router for another one, up to decode_attempts workers in all.
        Returns the worker that took it and its reply."""
        core = self.engine.core
        prep = KVPrepareRequest(
            request_id=req.request_id, token_ids=kv_tokens(req), resumed=len(req.resume_token_ids),
            sampling=req.sampling,
            stream_subject=req.stream_subject, page_size=core.config.page_size, kv_dtype=core.config.dtype,
            segment_pages=self.segment_pages, prefill_instance=self.instance_id, mm_items=list(req.mm_items))
        full: list[str] = []
        gone: list[str] = []
        grace_end = 0.0
        while True:
            try:
                return decode, await self._asking_again(functools.partial(self.prepare, decode, prep), "kv_prepare",
                                                        req.request_id, decode)
            except TimeoutError:
                await self._cancel_decode(req.request_id, decode)  # it may have reserved pages meanwhile
                raise DecodeSilent(f"decode {decode} did not answer kv_prepare within "
                                   f"{self.prepare_timeout_s}s") from None
            except Exception as exc:
                # only "full" (UNAVAILABLE) or "gone" is worth another decode worker
                # (Unavailable itself when the decode worker is called in-process, as in tests)
                is_full = isinstance(exc, Unavailable) or (isinstance(exc, RemoteError)
                                                           and exc.code is ErrorCode.UNAVAILABLE)
                if not (is_full or isinstance(exc, NoResponders)) or self.reroute is None:
                    raise HandoffError(f"decode {decode} refused the request: {exc}") from exc
                (full if is_full else gone).append(decode)
                tried = full + gone
                if len(tried) >= self.decode_attempts:
                    raise _no_decode(full, gone, str(exc)) from exc
                try:
                    decode = await self.reroute(req.request_id, kv_tokens(req), tried)
                except Exception as route_exc:
                    # a listed decode worker with no responders may be alive, its NATS client moving to another
                    # node of the cluster: when no other one is found, it is asked again for unreachable_grace_s
                    now = time.monotonic()
                    grace_end = grace_end or now + self.unreachable_grace_s
                    if not gone or now >= grace_end:
                        raise _no_decode(full, gone, f"{exc}; no other decode worker was found: {route_exc}") \
                            from route_exc
                    decode = gone.pop()
                    self.stats.reasked += 1
                    await asyncio.sleep(REASK_PAUSE_S)
                    continue
                self.stats.rerouted += 1
                log.info("hand-off rerouted", extra={"request": req.request_id, "refused": tried, "to": decode})

    # ------------------------------------------------------------------ 2-3. transfer and prefill
    async def _open_stream(self, req: GenerateRequest, reply: KVPrepareReply) -> KVSender:
        core = self.engine.core
        kv, layer_is_swa = core.runner.kv_access(), core.kv_layer_is_swa  # (every KV head, whatever our tp)
        plan = dg.plan_stream(len(kv_tokens(req)), core.config.page_size, core.cache.cfg.window, reply.hit_tokens,
                              self.segment_pages)
        try:
            async with asyncio.timeout(self.transfer_timeout_s):
                tx = await self.transfer.begin_send(reply.address, req.request_id,
                                                    layer_specs(dg.stream_specs(kv.shapes, layer_is_swa, plan)))
        except TimeoutError:
            raise HandoffError(f"KV transfer to {reply.address} was not accepted within "
                               f"{self.transfer_timeout_s}s") from None
        except Exception as exc:
            raise HandoffError(f"KV transfer to {reply.address} failed: {exc}") from exc
        return KVSender(tx, reply.address, kv, layer_is_swa, plan, self.transfer_timeout_s)

    async def _prefill(self, req: GenerateRequest, h: _Handoff, mm: MMEmbeddings | None = None) -> First | None:
        """Run the prompt prefill-only, its KV segments streaming out as they are computed; stops early when
        the stream breaks (decode gone or cancelled). None when the engine ended the request (aborted, or too
        long for this engine's pools): its final chunk is published here."""
        assert h.sender is not None
        ereq = Request(req.request_id, list(req.token_ids), engine_params(req.sampling), prefill_only=True,
                       on_progress=h.sender.collector, mm=mm, resumed=list(req.resume_token_ids))
        run = asyncio.ensure_future(self._last_output(ereq))
        try:
            await asyncio.wait({run, h.sender.task}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():  # the stream ended first: fine when every segment is sent, else stop computing
                failure = h.sender.task.exception()
                if failure is not None:
                    raise self._stream_error(h, failure)
            out = await run  # bounded by the engine's output timeout
        finally:
            if not run.done():
                run.cancel()  # leaving engine.generate() aborts the engine request: its pages are freed
                await asyncio.wait({run}, timeout=10)
        if out.finish_reason is not dg.FinishReason.PREFILLED:
            await self.publish(req.stream_subject, self._chunk(
                req.request_id, token_ids=list(out.new_token_ids), finish_reason=wire_finish(out.finish_reason),
                usage=Usage(prompt_tokens=len(req.token_ids),
                            completion_tokens=len(req.resume_token_ids) + len(out.new_token_ids))))
            return None
        h.held = True  # the engine keeps the prompt's KV until released (every segment is copied out by now)
        lp = wire_logprob(out.logprobs[0]) if out.logprobs else None
        return out.new_token_ids[0], lp, out.num_cached_tokens

    async def _last_output(self, ereq: Request) -> RequestOutput:
        outs = [o async for o in self.engine.generate(ereq)]  # one output: the first token (or a failure)
        return outs[-1]

    def _stream_error(self, h: _Handoff, exc: BaseException) -> HandoffError:
        address = h.sender.address if h.sender is not None else "?"
        if isinstance(exc, TimeoutError):
            return HandoffError(f"KV transfer to {address}: no layer sent within {self.transfer_timeout_s}s")
        return HandoffError(f"KV transfer to {address} failed: {exc}")

    # ------------------------------------------------------------------ 4-5. first token
    async def _settle(self, req: GenerateRequest, token: int) -> tuple[dg.FinishReason | None, FirstDrafts | None]:
        """Does the first token end the request? The same engine call takes the drafts after it (MTP in
        prefill: they go to decode with kv_commit) and releases the held KV into the prefix cache: every segment
        has been copied out of it."""
        params, request_id = engine_params(req.sampling), req.request_id

        def settle(core) -> tuple[dg.FinishReason | None, FirstDrafts | None]:  # engine thread
            reason = dg.first_token_finishes(core, params, token, req.resume_token_ids)
            drafts = core.first_drafts(request_id) if reason is None else None
            core.release(request_id, cache=True)
            return reason, drafts

        return await self.engine.call(settle)

    async def _finish_stream(self, h: _Handoff) -> TransferStats:
        assert h.sender is not None
        try:
            return await h.sender.finish(self.transfer_timeout_s)
        except Exception as exc:
            raise self._stream_error(h, exc) from exc

    async def _commit(self, req: GenerateRequest, decode: str, first: First, drafts: FirstDrafts | None) -> None:
        token, logprob, cached = first
        msg = KVCommitRequest(request_id=req.request_id, first_token_id=token, first_logprob=logprob,
                              prefill_cached_tokens=cached, drafts=list(drafts.drafts) if drafts else [],
                              draft_hidden=wire_hidden(drafts) if drafts else None)
        try:
            await self._commit_asking_again(decode, msg)
        except TimeoutError:
            raise HandoffError(f"decode {decode} did not answer kv_commit within {self.prepare_timeout_s}s") from None
        except Exception as exc:
            raise HandoffError(f"decode {decode} did not take the first token: {exc}") from exc

    async def _commit_asking_again(self, decode: str, msg: KVCommitRequest) -> None:
        """kv_commit, asked again as `_asking_again`; no responders too, for unreachable_grace_s (the decode
        worker holds the request's reservation and transfer: a live one whose NATS client is moving to another
        node answers again within it)."""
        grace_end = time.monotonic() + self.unreachable_grace_s
        while True:
            try:
                await self._asking_again(functools.partial(self.commit, decode, msg), "kv_commit", msg.request_id,
                                         decode)
                return
            except NoResponders:
                if time.monotonic() >= grace_end:
                    raise
                self.stats.reasked += 1
                await asyncio.sleep(REASK_PAUSE_S)

    async def _asking_again(self, ask: Callable[[], Awaitable[T]], what: str, request_id: str, decode: str) -> T:
        """`ask()` within prepare_timeout_s, asked again after every COMMIT_ATTEMPT_S without an answer (then
        TimeoutError): core NATS delivers at most once, and a NATS node that dies or hangs with the request or
        its reply on it loses it. Decode answers a repeat of a kv_prepare or kv_commit as it answered the first
        (a repeated kv_prepare joins the first: one reservation)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.prepare_timeout_s
        while True:
            attempt = min(COMMIT_ATTEMPT_S, deadline - loop.time())
            try:
                async with asyncio.timeout(attempt):
                    return await ask()
            except TimeoutError:
                if loop.time() >= deadline - 0.01:
                    raise
                log.info(f"{what} unanswered; asking again", extra={"request": request_id, "decode": decode})

    def _count(self, req: GenerateRequest, sender: KVSender, stats: TransferStats) -> None:
        core = self.engine.core
        self.stats.requests += 1
        self.stats.bytes_sent += stats.nbytes
        self.stats.full_equivalent_bytes += dg.full_transfer_bytes(
            sender.collector.kv.shapes, core.kv_layer_is_swa, len(kv_tokens(req)))
        self.stats.transfer_seconds += sender.send_seconds

    # ------------------------------------------------------------------ 6. cleanup
    async def _clean_up(self, request_id: str, h: _Handoff) -> None:
        """Give back what the request still holds. Decode's reservation is cancelled before the transfer is
        aborted, so decode ends quietly (the final chunk is already out) instead of reporting a failure."""
        if h.sender is not None:
            h.sender.task.cancel()  # no more segments
        if h.decode and not h.committed:
            await self._cancel_decode(request_id, h.decode)
        if h.sender is not None:
            await h.sender.abort("prefill stopped sending")  # a no-op once finished
        if h.held:
            with contextlib.suppress(KeyError):
                await self.engine.call(lambda core: core.release(request_id, cache=True))

    async def _cancel_decode(self, request_id: str, decode: str) -> None:
        try:
            async with asyncio.timeout(self.prepare_timeout_s):
                await self.commit(decode, KVCommitRequest(request_id=request_id, cancel=True))
        except Exception as exc:  # decode gone or done: its transfer fails (aborted below) and frees
            log.info("could not cancel the decode reservation",
                     extra={"request": request_id, "decode": decode, "error": repr(exc)})

    async def _publish_final(self, req: GenerateRequest, token: int, logprob: WireTokenLogprob | None, reason,
                             cached: int) -> None:
        await self.publish(req.stream_subject, self._chunk(
            req.request_id, token_ids=[token], logprobs=[] if logprob is None else [logprob],
            finish_reason=wire_finish(reason),
            usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=len(req.resume_token_ids) + 1,
                        cached_tokens=cached)))

    async def _safe_publish(self, req: GenerateRequest, chunk: TokenChunk) -> None:
        try:
            async with asyncio.timeout(5):
                await self.publish(req.stream_subject, chunk)
        except Exception as exc:  # NATS gone: the gateway's own bound reports the failure
            log.warning("could not publish final chunk", extra={"request": req.request_id, "error": repr(exc)})


def _no_decode(full: list[str], gone: list[str], why: str) -> HandoffError:
    """The error when no decode worker took the request: DecodesFull (retryable, worth a wait) when one of
    them was full, else a plain HandoffError naming the dead ones (the gateway fails the attempt over)."""
    if full:
        return DecodesFull(f"decode workers {full} refused the request (full)"
                           + (f" and {gone} are gone" if gone else "") + f": {why}")
    return HandoffError(f"decode workers {gone} are gone (no responders): {why}")
