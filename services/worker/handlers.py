"""Logic of the combined worker: one request = one engine generation streamed as TokenChunks.

`Generations.start()` runs an accepted `GenerateRequest` (the engine-worker base checked and acked it) as a
task of the base's registry: image embeddings are fetched first (a failed fetch ends the stream with a
retryable error before anything is admitted), then each engine output becomes a `TokenChunk`; the last
carries `finish_reason` and `usage`. An `AbortRequest` cancels the task, which aborts the request in the
engine and frees its KV; the stream ends with `finish_reason="abort"`. An engine failure ends it with
`finish_reason="error"` and the reason. Lifecycle: docs/worker.md, "Request tasks, aborts, drain".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from libs.engine.request import Request
from libs.mm.api import EncoderUnavailable
from libs.worker.mm import EmbeddingFetcher, fetch_embeddings
from libs.worker.tasks import RequestTasks
from libs.worker.wire import chunk_from_output, engine_params
from protos.messages import GenerateRequest, TokenChunk, Usage, WireFinishReason

log = logging.getLogger("windserve.worker")

Publish = Callable[[str, TokenChunk], Awaitable[None]]


class Generations:
    """Runs accepted GenerateRequests through the engine, one task each in `tasks`."""

    def __init__(self, engine, publish: Publish, tasks: RequestTasks, instance_id: str,
                 fetcher: EmbeddingFetcher | None = None) -> None:
        self._engine = engine  # AsyncEngine (duck-typed: generate(Request) async iterator)
        self._publish = publish
        self._tasks = tasks
        self._instance_id = instance_id
        self._fetcher = fetcher  # multimodal models: the images' embeddings, fetched before admission

    def start(self, req: GenerateRequest) -> asyncio.Task[None]:
        """Start generating `req` (already accepted); never blocks on the engine."""
        return self._tasks.spawn(req.request_id, self._run(req), aborted=self._send_final(req, WireFinishReason.ABORT),
                                 name=f"generate-{req.request_id}")

    async def _run(self, req: GenerateRequest) -> None:
        produced = 0
        try:
            mm = await fetch_embeddings(self._fetcher, req.mm_items)
        except EncoderUnavailable as exc:  # nothing was admitted: the client gets a 503 (retryable)
            await self._send_final(req, WireFinishReason.ERROR, f"worker {self._instance_id}: {exc}", retryable=True,
                                   error_code="encoder_unavailable")
            return
        request = Request(req.request_id, list(req.token_ids), engine_params(req.sampling), mm=mm,
                          resumed=list(req.resume_token_ids))
        produced = len(req.resume_token_ids)  # (usage counts the whole answer)
        try:
            async for out in self._engine.generate(request):
                produced += len(out.new_token_ids)
                await self._publish(req.stream_subject,
                                    chunk_from_output(out, self._instance_id, len(req.token_ids), produced))
        except asyncio.CancelledError:
            # Leaving engine.generate() aborted the request in the engine (KV freed).
            if self._tasks.cut:  # stopping past the drain bound: the gateway continues the stream elsewhere
                await self._send_final(req, WireFinishReason.ERROR, f"worker {self._instance_id} stopped (drain "
                                       "bound reached)", produced, instance_failed=True)
            else:
                await self._send_final(req, WireFinishReason.ABORT, produced=produced)
        except Exception as exc:
            log.exception("generation failed", extra={"request_id": req.request_id})
            # an engine that stopped (a lost parallel rank, a crash) takes this worker down: say so, so the gateway
            # treats it as a worker that is gone (retried elsewhere before the first token)
            failed = not getattr(self._engine, "is_running", True)
            await self._send_final(req, WireFinishReason.ERROR, f"worker {self._instance_id}: {exc}", produced,
                                   instance_failed=failed)

    async def _send_final(self, req: GenerateRequest, reason: WireFinishReason, error: str | None = None,
                          produced: int = 0, retryable: bool = False, instance_failed: bool = False,
                          error_code: str = "") -> None:
        chunk = TokenChunk(request_id=req.request_id, finish_reason=reason, error=error, retryable=retryable,
                           instance_failed=instance_failed, error_code=error_code,
                           usage=Usage(prompt_tokens=len(req.token_ids), completion_tokens=produced),
                           instance_id=self._instance_id)
        with contextlib.suppress(Exception):  # best effort: the reader may be gone (that is why we abort)
            async with asyncio.timeout(5):
                await self._publish(req.stream_subject, chunk)
