"""Prefill role logic: prefill-only engine run, then the KV hand-off to the chosen decode worker.

IO is injected (`prepare`: ask a decode worker to admit; `publish`: a TokenChunk to the gateway), so the
same code runs under NATS in the service and in-process in tests.

Lifecycle of one request (each wait bounded):
  1. prefill-only engine run -> first token, KV held in this engine;
  2. the first token already ends the request (EOS / stop / max_tokens=1): publish it, done;
  3. kv_prepare to the decode worker -> which prefix it already holds, where to send;
  4. stream the missing pages layer by layer over the transfer engine;
  5. always: release the held KV into the prefix cache (it is valid whatever happened downstream).
A failure in 3-4 is published on the stream as an error chunk (the decode side, when alive, publishes
its own; the gateway keeps the first final chunk).
Each request is one task of the engine-worker base's registry (libs/worker/tasks.py): an abort cancels it
(cleanup in run()'s `finally`), an abort that arrived before the request means it never runs and its stream
gets the abort chunk, and a draining service cancels what is left after its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from libs.bus import RemoteError
from libs.engine import AsyncEngine, Request
from libs.engine import disagg as dg
from libs.engine.core import HeldPrefill
from libs.transfer import KVTransferEngine, TransferStats
from libs.worker.tasks import RequestTasks
from libs.worker.wire import engine_params, wire_finish, wire_logprob
from protos.messages import (
    AckStatus,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    KVPrepareReply,
    KVPrepareRequest,
    TokenChunk,
    Usage,
)

log = logging.getLogger("windserve.prefill")

Prepare = Callable[[str, KVPrepareRequest], Awaitable[KVPrepareReply]]
Publish = Callable[[str, TokenChunk], Awaitable[None]]
# (request id, prompt tokens, decode workers that refused it) -> another decode worker's instance id
Reroute = Callable[[str, int, list[str]], Awaitable[str]]


def refusal(req: GenerateRequest) -> tuple[AckStatus, str] | None:
    """Why a prefill worker cannot serve `req` whatever its model (pure); the engine-worker base checks the
    rest (tokens, size, draining, duplicate ids)."""
    if req.token_ids and not req.decode_instance:
        return AckStatus.INVALID, "a prefill worker needs decode_instance (route through the router)"
    return None


@dataclass
class HandoffStats:
    """Totals over every shipped request (bytes are KV payload bytes)."""

    requests: int = 0
    bytes_sent: int = 0
    full_equivalent_bytes: int = 0
    transfer_seconds: float = 0.0
    failures: int = 0
    rerouted: int = 0  # hand-offs sent to another decode worker after one answered "full"

    def as_details(self) -> dict[str, str]:
        return {"kv_requests": str(self.requests), "kv_bytes_sent": str(self.bytes_sent),
                "kv_full_equivalent_bytes": str(self.full_equivalent_bytes),
                "kv_transfer_seconds": f"{self.transfer_seconds:.6f}", "kv_failures": str(self.failures),
                "kv_rerouted": str(self.rerouted)}


class HandoffError(RuntimeError):
    """The KV hand-off to decode failed; the message says at which step."""


class DecodesFull(HandoffError):
    """Every decode worker tried had no room for the request (or none other was found): retry later."""


class PrefillWorker:
    """Runs GenerateRequests in the prefill role. `transfer` is a started libs.transfer engine."""

    def __init__(self, engine: AsyncEngine, transfer: KVTransferEngine, instance_id: str, prepare: Prepare,
                 publish: Publish, *,
                 prepare_timeout_s: float = 10.0, transfer_timeout_s: float = 60.0, reroute: Reroute | None = None,
                 decode_attempts: int = 3, tasks: RequestTasks | None = None) -> None:
        self.engine = engine
        self.transfer = transfer
        self.instance_id = instance_id
        self.prepare = prepare
        self.publish = publish
        self.prepare_timeout_s = prepare_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.reroute = reroute
        self.decode_attempts = decode_attempts
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
        abort_chunk = self._chunk(req.request_id, finish_reason=FinishReason.ABORT)
        return self.tasks.spawn(req.request_id, self.run(req), aborted=self._safe_publish(req, abort_chunk),
                                name=f"prefill-{req.request_id}")

    async def abort(self, request_id: str) -> bool:
        """Client went away: stop computing / sending; the held KV is released by run()'s cleanup."""
        return await self.tasks.abort(request_id)

    async def run(self, req: GenerateRequest) -> None:
        """The whole lifecycle of one request; never raises (errors go to the stream)."""
        prefilled = False
        try:
            first = await self._prefill(req)
            if first is None:
                return
            prefilled = True  # the engine holds the prompt's KV from here on, until released below
            token, logprob, cached = first
            params = engine_params(req.sampling)
            reason = await self.engine.call(lambda core: dg.first_token_finishes(core, params, token))
            if reason is not None:
                await self._publish_final(req, token, logprob, reason, cached)
                return
            held = await self.engine.call(lambda core: core.held_prefill(req.request_id))
            await self._hand_off(req, held, token, logprob, cached)
        except asyncio.CancelledError:
            await self._safe_publish(req, self._chunk(req.request_id, finish_reason=FinishReason.ABORT))
            raise
        except Exception as exc:
            self.stats.failures += 1
            log.warning("prefill failed", extra={"request": req.request_id, "error": str(exc)})
            error = f"prefill {self.instance_id}: {exc}"
            await self._safe_publish(req, self._chunk(req.request_id, finish_reason=FinishReason.ERROR, error=error,
                                                      retryable=isinstance(exc, DecodesFull)))
        finally:
            if prefilled:  # also when an abort lands between the prefill and the hand-off
                await self._release(req.request_id)

    # ------------------------------------------------------------------ steps
    async def _prefill(self, req: GenerateRequest):
        """(first token, its logprob, cached tokens), or None when the engine aborted the request."""
        ereq = Request(req.request_id, list(req.token_ids), engine_params(req.sampling), prefill_only=True)
        outs = [o async for o in self.engine.generate(ereq)]  # one output: the first token (or a failure)
        out = outs[-1]
        if out.finish_reason is not dg.FinishReason.PREFILLED:
            # Aborted, or too long for this engine's pools (finished as length with no token).
            await self.publish(req.stream_subject, self._chunk(
                req.request_id, token_ids=list(out.new_token_ids),
                finish_reason=wire_finish(out.finish_reason),
                usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=len(out.new_token_ids))))
            return None
        lp = out.logprobs[0] if out.logprobs else None
        return out.new_token_ids[0], lp, out.num_cached_tokens

    async def _hand_off(self, req: GenerateRequest, held: HeldPrefill, token: int, logprob, cached: int) -> None:
        core = self.engine.core
        prep = KVPrepareRequest(
            request_id=req.request_id, token_ids=list(req.token_ids), first_token_id=token,
            first_logprob=None if logprob is None else wire_logprob(logprob), sampling=req.sampling,
            stream_subject=req.stream_subject, page_size=core.config.page_size, kv_dtype=core.config.dtype,
            prefill_instance=self.instance_id, prefill_cached_tokens=cached)
        reply = await self._prepare_decode(req, prep)
        stats = await self._send(req.request_id, held, reply)
        self.stats.requests += 1
        self.stats.bytes_sent += stats.nbytes
        self.stats.full_equivalent_bytes += dg.full_transfer_bytes(
            core.runner.kv, core.model_config.layer_is_swa, held.num_computed)
        self.stats.transfer_seconds += stats.seconds

    async def _prepare_decode(self, req: GenerateRequest, prep: KVPrepareRequest) -> KVPrepareReply:
        """kv_prepare on the routed decode worker; when it answers "full" (UNAVAILABLE), ask the router for
        another one, up to decode_attempts workers in all."""
        decode, refused = req.decode_instance, []
        while True:
            try:
                async with asyncio.timeout(self.prepare_timeout_s):
                    return await self.prepare(decode, prep)
            except TimeoutError:
                raise HandoffError(f"decode {decode} did not answer kv_prepare within "
                                   f"{self.prepare_timeout_s}s") from None
            except Exception as exc:
                # only "full" (UNAVAILABLE) is worth another decode worker
                if not isinstance(exc, RemoteError) or exc.code is not ErrorCode.UNAVAILABLE or self.reroute is None:
                    raise HandoffError(f"decode {decode} refused the request: {exc}") from exc
                refused.append(decode)
                if len(refused) >= self.decode_attempts:
                    raise DecodesFull(f"decode workers {refused} refused the request: {exc.message}") from exc
                try:
                    decode = await self.reroute(req.request_id, len(req.token_ids), refused)
                except Exception as route_exc:
                    raise DecodesFull(f"decode {refused[-1]} refused the request ({exc.message}) and no other "
                                      f"decode worker was found: {route_exc}") from route_exc
                self.stats.rerouted += 1
                log.info("hand-off rerouted", extra={"request": req.request_id, "refused": refused, "to": decode})

    async def _send(self, request_id: str, held: HeldPrefill, reply: KVPrepareReply) -> TransferStats:
        core = self.engine.core
        kv = core.runner.kv
        plan = dg.plan_shipment(held.num_computed, core.config.page_size, core.cache.cfg.window, reply.hit_tokens)
        layers = dg.shipment_layers(core.model_config.layer_is_swa, plan, held.full_pages, held.swa_pages)
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.transfer_timeout_s):
                tx = await self.transfer.begin_send(reply.address, request_id, dg.layer_specs(kv, layers))
                try:
                    for lp in layers:
                        await tx.send_layer(dg.gather_layer(kv, lp))
                    return await tx.finish()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await tx.abort("prefill stopped sending")
                    raise
        except TimeoutError:
            raise HandoffError(f"KV transfer to {reply.address} exceeded {self.transfer_timeout_s}s "
                               f"(after {time.perf_counter() - start:.1f}s)") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise HandoffError(f"KV transfer to {reply.address} failed: {exc}") from exc

    async def _release(self, request_id: str) -> None:
        with contextlib.suppress(KeyError):
            await self.engine.call(lambda core: core.release(request_id, cache=True))

    async def _publish_final(self, req: GenerateRequest, token: int, logprob, reason, cached: int) -> None:
        await self.publish(req.stream_subject, self._chunk(
            req.request_id, token_ids=[token],
            logprobs=[] if logprob is None else [wire_logprob(logprob)],
            finish_reason=wire_finish(reason),
            usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=1, cached_tokens=cached)))

    async def _safe_publish(self, req: GenerateRequest, chunk: TokenChunk) -> None:
        try:
            async with asyncio.timeout(5):
                await self.publish(req.stream_subject, chunk)
        except Exception as exc:  # NATS gone: the gateway's own bound reports the failure
            log.warning("could not publish final chunk", extra={"request": req.request_id, "error": repr(exc)})
