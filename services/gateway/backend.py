"""The gateway's downstream: route → generate → token stream over NATS, with aborts and liveness.

Contract with any worker that streams (combined worker, or prefill + decode in disaggregated mode):
1. the gateway subscribes to `windserve.stream.<request_id>` first, so no chunk can be missed;
2. it asks the router (`windserve.route`) for (prefill, decode); if no router answers (none is
   running) it picks the least-loaded live combined worker from the registry itself, with the router's
   own choice function (`libs.routing.pick_worker`);
3. it sends `GenerateRequest` to `windserve.worker.<prefill>.generate` (with `decode_instance` set
   when decode runs elsewhere) and waits, bounded, for a `GenerateAck` (a reply with only request
   and instance id is an acceptance);
4. `TokenChunk`s arrive on the stream subject; the last has `finish_reason`. When no chunk comes for
   `liveness_interval_s`, the workers the request depends on are probed (`windserve.health.<id>`);
   after `liveness_misses` failed probes in a row, or `idle_timeout_s` without chunks, the request
   fails with an error instead of hanging. Before the first chunk both prefill and decode instance
   are probed; afterwards only the instance that sends the chunks;
5. leaving the stream early (client gone, stop string found by the gateway) broadcasts
   `AbortRequest` on `windserve.abort`, which frees the request's KV everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from libs.bus import Bus, BusError, BusTimeout, NoResponders, RemoteError
from libs.kvcache.hashing import block_hashes
from libs.routing import DEFAULT_BUCKET_EDGES, LengthBuckets, instance_of, pick_worker
from protos import subjects
from protos.messages import (
    AbortRequest,
    AckStatus,
    GenerateAck,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    RegistryEntry,
    Role,
    RouteReply,
    RouteRequest,
    TokenChunk,
    WireFinishReason,
    WireSamplingParams,
)

log = logging.getLogger("windserve.gateway")


class BackendError(Exception):
    """The request cannot be served or failed downstream; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, code: str = "service_unavailable",
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After (capacity refusals)


class Backend(Protocol):
    def generate(self, request_id: str, token_ids: list[int], sampling: WireSamplingParams) -> AsyncIterator[TokenChunk]:
        """Yield the request's chunks up to the one with finish_reason; raise BackendError on failure.
        Closing the iterator early aborts the request downstream."""
        ...


_ACK_STATUS = {
    AckStatus.TOO_LARGE: (413, "context_length_exceeded"),
    AckStatus.INVALID: (400, "invalid_request"),
    AckStatus.BUSY: (503, "worker_busy"),
}


@dataclass(frozen=True)
class BackendConfig:
    page_size: int = 16
    route_timeout_s: float = 2.0
    ack_timeout_s: float = 30.0
    registry_timeout_s: float = 2.0
    liveness_interval_s: float = 1.0
    liveness_misses: int = 2
    idle_timeout_s: float = 300.0
    bucket_edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES
    namespace: str = subjects.DEFAULT_NAMESPACE
    retry_after_s: int = 1  # Retry-After of a capacity refusal (every decode worker full)

    def __post_init__(self) -> None:
        if min(self.route_timeout_s, self.ack_timeout_s, self.liveness_interval_s, self.idle_timeout_s) <= 0:
            raise ValueError("BackendConfig timeouts must be > 0")
        if self.liveness_misses < 1 or self.page_size < 1:
            raise ValueError("BackendConfig: liveness_misses and page_size must be >= 1")


ListWorkers = Callable[[], Awaitable[list[RegistryEntry]]]


class NatsBackend:
    """Backend over the bus. Cleanup (unsubscribe, abort) runs in tasks of its own, because the HTTP
    layer may cancel the consumer repeatedly and a cancelled `finally` cannot await."""

    def __init__(self, bus: Bus, list_workers: ListWorkers, config: BackendConfig) -> None:
        self._bus = bus
        self._list_workers = list_workers
        self.config = config
        self._buckets = LengthBuckets(config.bucket_edges)  # the fallback's, same as the router's
        self._cleanup: set[asyncio.Task[None]] = set()

    async def route(self, request_id: str, token_ids: list[int]) -> RouteReply:
        req = RouteRequest(request_id=request_id, num_tokens=len(token_ids),
                           block_hashes=block_hashes(token_ids, self.config.page_size))
        try:
            return await self._bus.request(subjects.route(self.config.namespace), req, RouteReply,
                                           self.config.route_timeout_s)
        except NoResponders:
            return await self._route_direct(request_id, len(token_ids))  # no router running
        except RemoteError as exc:
            raise BackendError(503, f"router could not place the request: {exc.message}") from exc
        except BusError as exc:
            raise BackendError(503, f"router did not answer: {exc}") from exc

    async def _route_direct(self, request_id: str, num_tokens: int) -> RouteReply:
        try:
            workers = await self._list_workers()
            worker = pick_worker([instance_of(w) for w in workers], num_tokens, self._buckets, request_id)
        except (LookupError, TimeoutError, BusError) as exc:
            raise BackendError(503, f"no router is running and no worker is available: {exc}") from exc
        return RouteReply(prefill_instance=worker.instance_id, decode_instance=worker.instance_id)

    async def generate(self, request_id: str, token_ids: list[int], sampling: WireSamplingParams
                       ) -> AsyncIterator[TokenChunk]:
        route = await self.route(request_id, token_ids)
        stream = subjects.stream(self.config.namespace, request_id)
        sub = await self._bus.subscribe(stream, TokenChunk)
        finished = False
        try:
            await self._submit(route, request_id, token_ids, sampling, stream)
            watch = {route.prefill_instance, route.decode_instance}
            async for chunk in self._chunks(sub, request_id, watch):
                if chunk.finish_reason is not None:
                    finished = True
                if chunk.finish_reason == WireFinishReason.ERROR and chunk.retryable:
                    raise BackendError(503, f"server is at capacity: {chunk.error}", code="server_busy",
                                       retry_after_s=self.config.retry_after_s)
                if chunk.finish_reason == WireFinishReason.ERROR:
                    raise BackendError(500, f"worker failed: {chunk.error}", code="worker_error")
                yield chunk
                if finished:
                    return
        finally:
            self._spawn(self._close(sub, request_id, abort=not finished))

    async def _submit(self, route: RouteReply, request_id: str, token_ids: list[int], sampling: WireSamplingParams,
                      stream: str) -> None:
        """Send the request to the prefill (or combined) worker and check its acknowledgement."""
        decode = route.decode_instance if route.decode_instance != route.prefill_instance else ""
        msg = GenerateRequest(request_id=request_id, token_ids=token_ids, sampling=sampling,
                              stream_subject=stream, decode_instance=decode)
        target = route.prefill_instance
        try:
            ack = await self._bus.request(subjects.generate(self.config.namespace, target), msg, GenerateAck,
                                          self.config.ack_timeout_s)
        except NoResponders as exc:
            raise BackendError(503, f"worker {target} is not reachable (gone?)") from exc
        except BusTimeout as exc:
            raise BackendError(503, f"worker {target} did not accept the request within "
                                    f"{self.config.ack_timeout_s}s") from exc
        except RemoteError as exc:
            raise BackendError(503, f"worker {target} refused the request: {exc.message}") from exc
        if ack.status != AckStatus.ACCEPTED:
            status, code = _ACK_STATUS[ack.status]
            raise BackendError(status, ack.message or f"worker {target}: {ack.status.value}", code=code)

    async def _chunks(self, sub, request_id: str, watch: set[str]) -> AsyncIterator[TokenChunk]:
        cfg = self.config
        last = time.monotonic()
        misses: dict[str, int] = {}
        first = True
        while True:
            try:
                chunk = await sub.next(cfg.liveness_interval_s)
            except BusTimeout:
                if time.monotonic() - last > cfg.idle_timeout_s:
                    raise BackendError(503, f"request {request_id}: no tokens for {cfg.idle_timeout_s}s") from None
                await self._probe(watch, misses)
                continue
            last = time.monotonic()
            if first and chunk.instance_id:
                watch, first = {chunk.instance_id}, False  # from now on only the streaming worker matters
            yield chunk

    async def _probe(self, instances: set[str], misses: dict[str, int]) -> None:
        for instance in sorted(instances):
            try:
                await self._bus.request(subjects.health(self.config.namespace, instance), HealthRequest(),
                                        HealthReply, self.config.liveness_interval_s)
                misses[instance] = 0
            except BusError as exc:
                misses[instance] = misses.get(instance, 0) + 1
                if misses[instance] >= self.config.liveness_misses:
                    raise BackendError(503, f"worker {instance} is gone ({misses[instance]} health probes "
                                            f"failed, last: {exc})", code="worker_gone") from exc

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def _close(self, sub, request_id: str, abort: bool) -> None:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if abort:
            try:
                await self._bus.publish(subjects.abort(self.config.namespace),
                                        AbortRequest(request_id=request_id, reason="client left"))
            except Exception as exc:
                log.warning("could not publish abort", extra={"request_id": request_id, "error": repr(exc)})

    async def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for pending cleanups, so aborts go out before the bus closes."""
        if self._cleanup:
            await asyncio.wait(set(self._cleanup), timeout=timeout)


async def list_workers_of(registry, timeout: float) -> list[RegistryEntry]:
    return await registry.list(Role.WORKER, timeout=timeout)
