"""Logic of the combined worker: wire ↔ engine conversions (pure) and the per-request generation tasks.

Request lifecycle on a worker:
1. `GenerateRequest` arrives on `windserve.worker.<id>.generate`; `Generations.accept()` checks it
   (pure: token ids, size against the pools, parameters) and answers a `GenerateAck` at once.
2. An accepted request runs as one asyncio task: `AsyncEngine.generate()` yields one output per
   engine step; each becomes a `TokenChunk` published on the request's stream subject. The last
   chunk carries `finish_reason` and `usage` (with `cached_tokens` from the prefix cache).
3. An `AbortRequest` (broadcast) cancels the task; leaving the engine's generator aborts the
   request inside the engine, which frees its KV. The stream ends with `finish_reason="abort"`.
4. An engine failure ends the stream with `finish_reason="error"` and the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from libs.engine.disagg._wire import engine_params, request_refusal, wire_finish, wire_logprob
from libs.engine.request import Request, RequestOutput
from libs.kvcache.types import PoolUsage
from protos.messages import (
    AckStatus,
    FinishReason,
    GenerateAck,
    GenerateRequest,
    TokenChunk,
    Usage,
    WorkerLoad,
)
from services.worker.config import WorkerConfig

log = logging.getLogger("windserve.worker")

Publish = Callable[[str, TokenChunk], Awaitable[None]]

# --- pure conversions (wire <-> engine: libs.engine.disagg._wire, shared with prefill/decode) ----------------


def chunk_from_output(out: RequestOutput, instance_id: str, prompt_tokens: int, completion_tokens: int) -> TokenChunk:
    """One engine output → one TokenChunk; `completion_tokens` counts every token produced so far."""
    logprobs = [wire_logprob(lp) for lp in out.logprobs or ()]
    finished = out.finished and out.finish_reason is not None
    return TokenChunk(
        request_id=out.req_id,
        token_ids=list(out.new_token_ids),
        logprobs=logprobs,
        finish_reason=wire_finish(out.finish_reason) if finished else None,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    cached_tokens=out.num_cached_tokens) if finished else None,
        instance_id=instance_id,
    )


def refusal(req: GenerateRequest, config: WorkerConfig, vocab_size: int) -> GenerateAck | None:
    """Why this worker can never serve `req` (an ack to send back), or None when it can."""
    reason = request_refusal(req, vocab_size, config.max_request_tokens)
    if reason is None:
        return None
    return GenerateAck(request_id=req.request_id, instance_id=config.instance_id, status=reason[0], message=reason[1])


def load_from(usage: PoolUsage, running: int, waiting: int, now: float) -> WorkerLoad:
    """Registry load snapshot from the cache's pool usage and the scheduler's queue lengths."""
    return WorkerLoad(
        running=running, waiting=waiting,
        kv_full_used=usage.full.in_use, kv_full_total=usage.full.capacity,
        kv_swa_used=usage.swa.in_use, kv_swa_total=usage.swa.capacity,
        updated_at=now,
    )


# --- generation tasks -------------------------------------------------------------------------


@dataclass
class Counters:
    accepted: int = 0
    refused: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0


class Generations:
    """The worker's in-flight requests: one task each, cancellable by request id."""

    def __init__(self, engine, publish: Publish, config: WorkerConfig, vocab_size: int) -> None:
        self._engine = engine  # AsyncEngine (duck-typed: generate(Request) async iterator)
        self._publish = publish
        self._config = config
        self._vocab_size = vocab_size
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._recent_aborts: OrderedDict[str, None] = OrderedDict()
        self.counters = Counters()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def accept(self, req: GenerateRequest, draining: bool = False) -> GenerateAck:
        """Start generating `req` unless it is refused; never blocks on the engine."""
        refused = self._refuse(req, draining)
        if refused is not None:
            self.counters.refused += 1
            return refused
        self.counters.accepted += 1
        if req.request_id in self._recent_aborts:  # the client left before the request got here
            self.counters.aborted += 1
            self._spawn(req.request_id, self._send_final(req, FinishReason.ABORT, None))
        else:
            self._spawn(req.request_id, self._run(req))
        return GenerateAck(request_id=req.request_id, instance_id=self._config.instance_id)

    def _refuse(self, req: GenerateRequest, draining: bool) -> GenerateAck | None:
        if draining:
            return GenerateAck(request_id=req.request_id, instance_id=self._config.instance_id,
                               status=AckStatus.BUSY, message="worker is draining")
        if req.request_id in self._tasks:
            return GenerateAck(request_id=req.request_id, instance_id=self._config.instance_id,
                               status=AckStatus.INVALID, message=f"request id {req.request_id!r} is already running")
        return refusal(req, self._config, self._vocab_size)

    def _spawn(self, request_id: str, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks[request_id] = task
        task.add_done_callback(lambda t: self._tasks.pop(request_id, None) if self._tasks.get(request_id) is t else None)

    def abort(self, request_id: str) -> bool:
        """Cancel a running request (its KV is freed by the engine). Unknown ids are remembered, since
        an abort can overtake its generate request on the bus."""
        task = self._tasks.get(request_id)
        if task is None:
            self._recent_aborts[request_id] = None
            while len(self._recent_aborts) > self._config.recent_aborts:
                self._recent_aborts.popitem(last=False)
            return False
        task.cancel()
        return True

    async def drain(self, timeout: float) -> None:
        """Let running requests finish for up to `timeout` s, then abort the rest."""
        tasks = set(self._tasks.values())
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)

    async def _run(self, req: GenerateRequest) -> None:
        request = Request(req.request_id, list(req.token_ids), engine_params(req.sampling))
        produced = 0
        try:
            async for out in self._engine.generate(request):
                produced += len(out.new_token_ids)
                chunk = chunk_from_output(out, self._config.instance_id, len(req.token_ids), produced)
                await self._publish(req.stream_subject, chunk)
                if chunk.finish_reason is not None:
                    self._count_finish(chunk.finish_reason)
        except asyncio.CancelledError:
            # Leaving engine.generate() aborted the request in the engine (KV freed).
            self.counters.aborted += 1
            await self._send_final(req, FinishReason.ABORT, None, produced)
        except Exception as exc:
            log.exception("generation failed", extra={"request_id": req.request_id})
            self.counters.failed += 1
            await self._send_final(req, FinishReason.ERROR, f"worker {self._config.instance_id}: {exc}", produced)

    def _count_finish(self, reason: FinishReason) -> None:
        if reason == FinishReason.ABORT:
            self.counters.aborted += 1
        else:
            self.counters.finished += 1

    async def _send_final(self, req: GenerateRequest, reason: FinishReason, error: str | None,
                          produced: int = 0) -> None:
        chunk = TokenChunk(request_id=req.request_id, finish_reason=reason, error=error,
                           usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=produced),
                           instance_id=self._config.instance_id)
        with contextlib.suppress(Exception):  # best effort: the reader may be gone (that is why we abort)
            await self._publish(req.stream_subject, chunk)
