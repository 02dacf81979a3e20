"""The gateway's downstream: route → generate → token stream over NATS, with aborts, liveness and failover.

`NatsBackend` refuses a request no live worker can hold (400 before anything computes), subscribes to the
attempt's stream before submitting it, and routes via the routers, or from the registry when none runs or
answers in time. Promises: no request hangs on a dead or silent worker; until its first chunk reached the
client, a request whose worker is gone or busy is retried elsewhere (`max_attempts`, `failover_timeout_s`),
afterwards it ends with an error; leaving a stream early aborts it downstream; an unreachable NATS is
reported as the control plane's failure, never a worker's. Lifecycle and status codes: docs/gateway.md,
"Request lifecycle" and "Errors".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from pydantic import BaseModel

from libs.buckets import BucketConfig, LengthBuckets
from libs.bus import Bus, BusError, BusTimeout, NoResponders, RemoteError
from libs.kvcache import DEFAULT_HASH_SEED
from libs.kvcache.hashing import block_hashes
from protos import subjects
from protos.messages import (
    AbortRequest,
    AckStatus,
    ErrorCode,
    GenerateAck,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    RegistryEntry,
    RouteReply,
    RouteRequest,
    StreamReplayReply,
    StreamReplayRequest,
    TokenChunk,
    WireFinishReason,
    WireMMItem,
    WireSamplingParams,
)
from services.gateway import metrics
from services.gateway.failover import Avoid, Registered, fallback_pick, repick, too_large
from services.gateway.readiness import CachedListing

log = logging.getLogger("windserve.gateway")

Rep = TypeVar("Rep", bound=BaseModel)


class BackendError(Exception):
    """The request cannot be served or failed downstream; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str, code: str = "service_unavailable",
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After (503s: capacity, gone, unreachable)


class PeerFailed(BackendError):
    """A worker of this attempt is gone or refused it as busy: another instance may serve the request.
    `decode` tells which exclusion list names `instance`; `unreachable`: nothing listened on its subject (no
    responders), which is also what a live worker looks like for a moment while its client moves to another
    node of a NATS cluster."""

    def __init__(self, message: str, instance: str, decode: bool = False, code: str = "worker_gone",
                 retry_after_s: int | None = None, unreachable: bool = False) -> None:
        super().__init__(503, message, code=code, retry_after_s=retry_after_s)
        self.instance = instance
        self.decode = decode
        self.unreachable = unreachable


class Backend(Protocol):
    def generate(self, request_id: str, token_ids: list[int],
                 sampling: WireSamplingParams) -> AsyncIterator[TokenChunk]:
        """Yield the request's chunks up to the one with finish_reason; raise BackendError on failure.
        Closing the iterator early aborts the request downstream. A request with images is called with the keyword
        `mm_items` (a sequence of WireMMItem) as well (NatsBackend takes it)."""
        ...


_ACK_STATUS = {
    AckStatus.TOO_LARGE: (400, "context_length_exceeded"),
    AckStatus.INVALID: (400, "invalid_request"),
}


@dataclass(frozen=True)
class BackendConfig:
    """How the gateway places a request and follows it: routing, acceptance, liveness, failover."""

    route_timeout_s: float = 2.0
    """Most wait for a router's answer, every router asked together; past it (routers registered but silent)
    the request is placed from the registry."""
    route_try_timeout_s: float = 0.75
    """Most wait for one router's answer before the next registered router is asked (within route_timeout_s)."""
    router_suspect_s: float = 5.0
    """A router that did not answer is asked last among the routers for this long."""
    ack_timeout_s: float = 30.0
    """Most wait for a worker to accept a request."""
    liveness_interval_s: float = 1.0
    """Without tokens for this long, the gateway probes the worker's health."""
    liveness_misses: int = 2
    """Failed probes in a row after which a worker is gone."""
    liveness_silent_s: float = 6.0
    """A worker whose probes time out (its subscriptions still stand, e.g. its NATS node hangs) is gone only
    after this long silent."""
    idle_timeout_s: float = 300.0
    """Longest gap between two chunks of a live worker before the request fails."""
    buckets: BucketConfig = field(default_factory=BucketConfig)
    """The length buckets of the no-router fallback, the router's and the engines'."""
    retry_after_s: int = 1
    """Retry-After (seconds) sent with 429 and with every 503."""
    max_attempts: int = 3
    """Attempts of one request: before its first token, a request whose worker is gone or refuses as busy is
    retried on another instance (1 = no failover)."""
    failover_timeout_s: float = 30.0
    """No retry starts later than this after the request's first attempt (or its latest migration)."""
    max_migrations: int = 3
    """Times one stream may move to another instance after its worker failed mid-stream: the new worker gets the
    prompt and the tokens already sent and continues after them (docs/faults.md). 0 = the stream ends with the
    worker_gone error."""
    reconnect_bound_s: float = 10.0
    """NATS unreachable this long fails a waiting request (control plane down)."""
    unreachable_grace_s: float = 1.5
    """A listed router or worker with no responders (gone, or its client moving to another NATS node) is asked
    again this long when nothing else can take the request; a streaming worker is gone only once its probes
    found no responders this long."""
    fleet_cache_s: float = 0.5
    """Age of the registry listing reused for size checks and fallbacks."""

    def __post_init__(self) -> None:
        if min(self.route_timeout_s, self.route_try_timeout_s, self.router_suspect_s, self.ack_timeout_s,
               self.liveness_interval_s, self.idle_timeout_s, self.failover_timeout_s, self.reconnect_bound_s,
               self.unreachable_grace_s) <= 0:
            raise ValueError("BackendConfig timeouts must be > 0")
        if self.liveness_misses < 1 or self.max_attempts < 1 or self.retry_after_s < 1:
            raise ValueError("BackendConfig: liveness_misses, max_attempts and retry_after_s must be >= 1")
        if self.max_migrations < 0:
            raise ValueError("BackendConfig: max_migrations must be >= 0")
        if self.liveness_interval_s >= self.idle_timeout_s:
            raise ValueError("liveness_interval_s must be below idle_timeout_s")


ListServices = Callable[[], Awaitable[list[RegistryEntry]]]


@dataclass
class _Liveness:
    """One attempt's probe state: failed probes in a row per instance, and since when NATS is unreachable."""

    misses: dict[str, int] = field(default_factory=dict)
    disconnected_since: float | None = None
    silent_since: dict[str, float] = field(default_factory=dict)  # first probe of the current run of timeouts
    unreachable_since: dict[str, float] = field(default_factory=dict)  # first of the current run of no responders


@dataclass
class _StreamOrder:
    """One attempt's next expected chunk number per sending worker."""

    expected: dict[str, int] = field(default_factory=dict)


DEFAULT_PAGE_SIZE = 16  # the block-hash page of a route until a worker advertises its kv_page_size label
_MIN_TRY_S = 0.05  # a router try shorter than this is not started (the route's bound is spent)
_REASK_PAUSE_S = 0.1  # between two asks of a listed peer that had no responders (within unreachable_grace_s)
_RECONNECT_POLL_S = 0.05  # how often a request waiting for NATS to come back looks at the connection


def _discard(task: asyncio.Future) -> None:
    """Cancel `task` if it still runs, and consume its outcome (no "exception never retrieved")."""
    if not task.done():
        task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


class RoutersSilent(Exception):
    """Routers are registered (or subscribed) but none answered the route within `route_timeout_s`."""

    def __init__(self, tried: list[str], bound_s: float) -> None:
        super().__init__(f"no router answered within {bound_s}s (tried {'; '.join(tried) or 'none'})")
        self.tried = tried


class NatsBackend:
    """Backend over the bus. Cleanup (unsubscribe, abort) runs in tasks of its own, because the HTTP
    layer may cancel the consumer repeatedly and a cancelled `finally` cannot await."""

    def __init__(self, bus: Bus, list_services: ListServices, config: BackendConfig, *,
                 namespace: str = subjects.DEFAULT_NAMESPACE, registry_timeout_s: float = 2.0) -> None:
        self._bus = bus
        self.namespace = namespace
        self.registry_timeout_s = registry_timeout_s
        # the gateway passes its shared listing; a bare function gets a cache of its own
        self._listing = (list_services if isinstance(list_services, CachedListing)
                         else CachedListing(list_services, config.fleet_cache_s))
        self.config = config
        self._buckets = LengthBuckets(config.buckets.bucket_edges)  # the fallback's, same as the router's
        self._cleanup: set[asyncio.Task[None]] = set()
        self._router_turn = itertools.count()  # spreads routes over the registered routers
        self._silent_routers: dict[str, float] = {}  # router -> monotonic time it last failed to answer

    # --- errors -----------------------------------------------------------------------------------

    def unavailable(self, message: str, code: str = "service_unavailable") -> BackendError:
        return BackendError(503, message, code=code, retry_after_s=self.config.retry_after_s)

    def _control_plane(self, what: str, exc: BaseException | None = None) -> BackendError | None:
        """The error naming NATS when it is unreachable (what failed is its symptom), else None."""
        if self._bus.is_connected:
            return None
        detail = f" ({exc})" if exc is not None else ""
        return self.unavailable(f"the control plane (NATS) is unreachable: {what} failed{detail}",
                                code="control_plane_unavailable")

    async def _request(self, subject: str, msg: BaseModel, reply_model: type[Rep], timeout: float, what: str) -> Rep:
        """bus.request; any failure while NATS is unreachable becomes the control-plane error."""
        try:
            return await self._bus.request(subject, msg, reply_model, timeout)
        except Exception as exc:
            down = self._control_plane(what, exc)
            if down is not None:
                raise down from exc
            if isinstance(exc, BusError):
                raise
            raise BusError(f"{what}: {exc!r}") from exc  # a nats client error while connected

    # --- registry ---------------------------------------------------------------------------------

    async def fleet(self, fresh: bool = False, wait: bool = True) -> Registered:
        """The registry's live entries by role (a listing at most `fleet_cache_s` old unless `fresh`).
        `wait=False` (advisory reads: the size check, the chain layout): the last listing at once, refreshed
        in the background (`CachedListing`), so no request waits for the registry there."""
        try:  # (the listing bounds its own reads by registry_timeout_s; this is a safety net)
            async with asyncio.timeout(self.registry_timeout_s + 1.0):
                entries = await self._listing(fresh=fresh, wait=wait)
        except Exception as exc:
            raise self._control_plane("listing the registry", exc) or self.unavailable(
                f"the registry could not be read: {exc!r}") from exc
        return Registered.of(entries, time.time())

    async def _check_fits(self, num_tokens: int, max_tokens: int) -> None:
        """400 before anything computes when no live path can ever hold the request (skipped when the registry
        cannot be read: routing then reports the real cause)."""
        try:
            fleet = await self.fleet(wait=False)
        except BackendError:
            return
        reason = too_large(fleet, num_tokens, max_tokens)
        if reason is not None:
            raise BackendError(400, reason, code="context_length_exceeded")

    # --- routing ----------------------------------------------------------------------------------

    async def route(self, request_id: str, token_ids: list[int], avoid: Avoid | None = None,
                    mm_hashes: Sequence[int] = ()) -> RouteReply:
        avoid = avoid or Avoid()
        req = RouteRequest(request_id=request_id, num_tokens=len(token_ids),
                           block_hashes=await self._chain(token_ids), mm_hashes=list(mm_hashes),
                           exclude_instances=sorted(avoid.instances), exclude_decodes=sorted(avoid.decodes))
        grace_end = time.monotonic() + self.config.unreachable_grace_s
        while True:
            try:
                reply = await self._ask_routers(req)
                break
            except NoResponders:  # no router running, or the listed ones are moving to another NATS node
                try:
                    return await self._route_direct(request_id, len(token_ids), avoid)
                except BackendError:
                    if time.monotonic() >= grace_end or not await self._routers_listed():
                        raise
                await asyncio.sleep(_REASK_PAUSE_S)
            except RemoteError as exc:
                raise self.unavailable(f"router could not place the request: {exc.message}") from exc
            except RoutersSilent as exc:
                return await self._place_without_router(request_id, len(token_ids), avoid, exc)
        if avoid and avoid.hits(reply.prefill_instance, reply.decode_instance):
            return await self._repick(request_id, len(token_ids), avoid, reply)
        return reply

    async def _route_reachable(self, request_id: str, token_ids: list[int], avoid: Avoid,
                               mm_hashes: Sequence[int]) -> RouteReply:
        """`route`, and when it fails because NATS is unreachable (this gateway's client is moving to another
        node of a cluster: nats-py may wait its 1 s reconnect pause first; or NATS restarts), the same route
        again once the connection is back, within `reconnect_bound_s`: nothing was sent to a worker yet, so a
        new request does not fail on a reconnect that an in-flight stream rides out."""
        deadline: float | None = None
        while True:
            try:
                return await self.route(request_id, token_ids, avoid, mm_hashes)
            except BackendError as exc:
                if exc.code != "control_plane_unavailable":
                    raise
                deadline = deadline or time.monotonic() + self.config.reconnect_bound_s
                if not await self._reconnected(deadline):
                    raise
                metrics.CONTROL_PLANE_WAITS.inc()
                log.info("NATS reachable again: routing the request again", extra={"request_id": request_id})

    async def _subscribe(self, stream: str, request_id: str):
        """The attempt's stream subscription. A failure (the NATS node of this gateway's client hangs, so the
        subscription's flush times out, or the client is reconnecting) is tried again within `reconnect_bound_s`:
        nothing was sent to a worker yet, and the client leaves a hung node within its ping bound."""
        deadline: float | None = None
        while True:
            try:
                return await self._bus.subscribe(stream, TokenChunk)
            except Exception as exc:
                deadline = deadline or time.monotonic() + self.config.reconnect_bound_s
                if time.monotonic() >= deadline or not await self._reconnected(deadline):
                    raise (self._control_plane("subscribing to the stream", exc)
                           or self.unavailable(f"subscribing to the stream failed: {exc!r}")) from exc
                metrics.CONTROL_PLANE_WAITS.inc()
                log.info("subscribing to the stream again", extra={"request_id": request_id, "error": repr(exc)})
                await asyncio.sleep(_RECONNECT_POLL_S)

    async def _reconnected(self, deadline: float) -> bool:
        """Whether the bus is connected by `deadline` (looked at every `_RECONNECT_POLL_S`)."""
        while not self._bus.is_connected:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_RECONNECT_POLL_S)
        return True

    async def _routers_listed(self) -> bool:
        try:
            return bool((await self.fleet(wait=False)).routers)
        except BackendError:
            return False

    async def _ask_routers(self, req: RouteRequest) -> RouteReply:
        """The first answer of a router, within `route_timeout_s` in all: each registered router by name (in turn;
        those that lately did not answer last) for at most `route_try_timeout_s`, then the queue group until the
        bound. Raises NoResponders when nothing listens anywhere (no router running), RoutersSilent when
        something listens but nothing answered in time, RemoteError when the routers that answered all said they
        cannot place the request (one refusing is passed over: its registry view may lag the others')."""
        cfg = self.config
        ns = self.namespace
        deadline = time.monotonic() + cfg.route_timeout_s
        silent: list[str] = []
        refused: RemoteError | None = None
        passed_over = 0  # named routers that did not give an answer to use

        async def ask(subject: str, what: str) -> RouteReply:
            timeout = min(cfg.route_try_timeout_s, deadline - time.monotonic())
            return await self._request(subject, req, RouteReply, timeout, what)

        for router in await self._router_order():
            if deadline - time.monotonic() < _MIN_TRY_S:
                break
            if passed_over:
                metrics.ROUTE_RETRIES.inc()
            try:
                reply = await ask(subjects.router_route(ns, router), f"asking router {router}")
            except RemoteError as exc:  # its view may lag (just started or resumed): the next one may place it
                refused, passed_over = refused or exc, passed_over + 1
                continue
            except NoResponders:  # gone (listed until its entry expires), or a router of an older release
                self._silent_routers[router] = time.monotonic()
                passed_over += 1
                continue
            except BusError as exc:  # silent: hung, or behind a hung NATS node
                self._silent_routers[router] = time.monotonic()
                silent.append(f"{router}: {exc}")
                passed_over += 1
                log.warning("router did not answer; asking another", extra={"request_id": req.request_id,
                                                                            "router": router, "error": str(exc)})
                continue
            self._silent_routers.pop(router, None)
            return reply
        if refused is not None:  # every router that answered refused it (the queue group holds the same ones)
            raise refused
        while deadline - time.monotonic() >= _MIN_TRY_S:  # a router the listing does not show (yet), or none listed
            try:
                return await ask(subjects.route(ns), "asking the router")
            except NoResponders:
                if silent:  # a silent router left meanwhile: no router answers
                    break
                raise
            except RemoteError:
                raise
            except BusError as exc:
                silent.append(f"queue group {subjects.ROUTER_QUEUE}: {exc}")
        raise RoutersSilent(silent, cfg.route_timeout_s)

    async def _router_order(self) -> list[str]:
        """The fresh registered routers to ask, in turn from one route to the next, those that did not answer
        within the last `router_suspect_s` last (oldest silence first). Empty when the registry cannot be read."""
        try:
            routers = sorted(e.instance_id for e in (await self.fleet(wait=False)).routers)
        except BackendError:
            return []
        now = time.monotonic()
        self._silent_routers = {r: t for r, t in self._silent_routers.items()
                                if now - t < self.config.router_suspect_s}
        if routers:
            k = next(self._router_turn) % len(routers)
            routers = routers[k:] + routers[:k]
        return sorted(routers, key=lambda r: self._silent_routers.get(r, float("-inf")))  # (stable sort)

    async def _place_without_router(self, request_id: str, num_tokens: int, avoid: Avoid,
                                    silent: RoutersSilent) -> RouteReply:
        """No router answered in time: place the request from the registry with the router's own choice functions
        (pairs too; no prefix affinity), or 503 naming both failures."""
        try:
            prefill, decode = repick(await self.fleet(), num_tokens, self._buckets, request_id, avoid)
        except LookupError as exc:
            raise self.unavailable(f"router did not answer: {silent}; and no worker can be placed from the "
                                   f"registry: {exc}", code="router_unavailable") from exc
        metrics.ROUTER_BYPASSED.inc()
        log.warning("no router answered: placed from the registry", extra={
            "request_id": request_id, "prefill": prefill, "decode": decode, "error": str(silent)})
        return RouteReply(prefill_instance=prefill, decode_instance=decode)

    async def _chain(self, token_ids: list[int]) -> list[int]:
        """The prompt's block-hash chain, made as the workers' caches make theirs (their advertised page size
        and seed; the default page size and seed until one advertises them)."""
        try:
            layout = (await self.fleet(wait=False)).hash_layout()
        except BackendError:
            layout = None
        page_size, seed = layout or (DEFAULT_PAGE_SIZE, DEFAULT_HASH_SEED)
        return block_hashes(token_ids, page_size, seed)

    async def _route_direct(self, request_id: str, num_tokens: int, avoid: Avoid) -> RouteReply:
        fleet = await self.fleet(fresh=bool(avoid))
        try:
            worker = fallback_pick(fleet, num_tokens, self._buckets, request_id, avoid)
        except LookupError as exc:
            raise self.unavailable(f"no router is running (nothing answers {subjects.route(self.namespace)}) "
                                   f"and no combined worker can take the request: {exc}",
                                   code="router_unavailable") from exc
        return RouteReply(prefill_instance=worker, decode_instance=worker)

    async def _repick(self, request_id: str, num_tokens: int, avoid: Avoid, reply: RouteReply) -> RouteReply:
        """The router named an instance this request failed on (it ignores exclusions, or still lists a dead
        instance): choose without it from the registry, with the router's own choice functions."""
        try:
            prefill, decode = repick(await self.fleet(fresh=True), num_tokens, self._buckets, request_id, avoid)
        except LookupError as exc:
            raise self.unavailable(f"no live instance besides {avoid} (which failed this request): {exc}") from exc
        log.info("router pick avoided", extra={"request_id": request_id, "router": reply.prefill_instance,
                                                 "instead": prefill})
        return RouteReply(prefill_instance=prefill, decode_instance=decode)

    # --- generation with failover -----------------------------------------------------------------

    async def generate(self, request_id: str, token_ids: list[int], sampling: WireSamplingParams,
                       mm_items: Sequence[WireMMItem] = ()) -> AsyncIterator[TokenChunk]:
        await self._check_fits(len(token_ids), sampling.max_tokens)
        cfg = self.config
        avoid = Avoid()
        unreachable = Avoid()  # the failed instances that only had no responders
        tried = Avoid()  # every instance an attempt failed on
        deadline = time.monotonic() + cfg.failover_timeout_s
        grace_end: float | None = None  # re-asking those until then, when nothing else can take the request
        failed = 0  # attempts that failed on an instance (a re-ask of an unreachable one within the grace: free)
        reask = False
        sent_ids: list[int] = []  # tokens the client got: a stream that migrates continues after them
        migrations = 0
        gone: PeerFailed | None = None  # the failure the stream is migrating away from
        resumed = 0  # tokens sent when the stream last migrated
        for attempt in itertools.count():
            attempt_id = request_id if attempt == 0 else f"{request_id}-r{attempt}"
            sent = False
            try:
                async for chunk in self._attempt(attempt_id, token_ids, sampling, avoid, mm_items, sent_ids):
                    sent = True
                    sent_ids.extend(chunk.token_ids)
                    if migrations and chunk.usage is not None:
                        chunk = _migrated_usage(chunk, len(token_ids), resumed)
                    yield chunk
                return
            except PeerFailed as exc:
                now = time.monotonic()
                tried.add(exc.instance, exc.decode)
                if sent_ids and migrations < cfg.max_migrations and len(sent_ids) < sampling.max_tokens:
                    # the stream started: it moves to a live worker, which continues after the tokens sent
                    migrations += 1
                    gone, resumed = exc, len(sent_ids)
                    avoid.add(exc.instance, exc.decode)
                    deadline, failed, grace_end, reask = now + cfg.failover_timeout_s, 0, None, False
                    metrics.MIGRATIONS.inc()
                    log.warning("stream migrating to another instance", extra={
                        "request_id": request_id, "migration": migrations, "failed": exc.instance,
                        "tokens_sent": len(sent_ids), "error": exc.message})
                    continue
                free = reask and exc.unreachable and grace_end is not None and now < grace_end
                if sent or sent_ids or now >= deadline or (failed + 1 >= cfg.max_attempts and not free):
                    if not sent and attempt:
                        exc.message = f"{exc.message} (after {attempt + 1} attempts on {tried})"
                    exc.retry_after_s = cfg.retry_after_s
                    raise
                failed += 0 if free else 1
                avoid.add(exc.instance, exc.decode)
                if exc.unreachable:
                    unreachable.add(exc.instance, exc.decode)
                    grace_end = grace_end or now + cfg.unreachable_grace_s
                metrics.FAILOVERS.inc()
                log.info("retrying on another instance", extra={"request_id": request_id, "attempt": attempt + 1,
                                                                "failed": exc.instance, "error": exc.message})
                reask = False
            except BackendError as exc:
                if gone is not None and not sent:  # no instance could take the migrating stream: its failure
                    gone.message = f"{gone.message}; the stream could not move to another instance: {exc.message}"
                    gone.retry_after_s = cfg.retry_after_s
                    raise gone from exc
                # nothing but the instances this request failed on can take it: when each only had no
                # responders (its client may be moving to another NATS node), ask them again within the grace
                if (sent or sent_ids or reask or not avoid or avoid != unreachable or grace_end is None
                        or time.monotonic() >= min(grace_end, deadline)):
                    raise
                await asyncio.sleep(_REASK_PAUSE_S)
                avoid, reask = Avoid(), True
                metrics.REASKS.inc()
                log.info("asking an unreachable instance again", extra={"request_id": request_id,
                                                                         "instances": str(unreachable)})

    async def _attempt(self, attempt_id: str, token_ids: list[int], sampling: WireSamplingParams, avoid: Avoid,
                       mm_items: Sequence[WireMMItem] = (), resume: Sequence[int] = ()) -> AsyncIterator[TokenChunk]:
        """One attempt: route, submit, stream. Raises PeerFailed when a peer of the attempt is gone or busy.
        `resume`: the tokens a migrating stream already sent (routed with the prompt: its KV may be cached)."""
        route = await self._route_reachable(attempt_id, [*token_ids, *resume], avoid, [i.mm_hash for i in mm_items])
        resume = list(resume)  # (the caller extends its list while this attempt streams)
        stream = subjects.stream(self.namespace, attempt_id)
        sub = await self._subscribe(stream, attempt_id)
        finished = sent = False
        try:
            await self._submit(route, attempt_id, token_ids, sampling, stream, mm_items, resume)
            watch = {route.prefill_instance, route.decode_instance}
            async for chunk in self._chunks(sub, attempt_id, watch, route):
                if chunk.finish_reason is not None:
                    finished = True
                if chunk.finish_reason == WireFinishReason.ERROR:
                    raise await self._chunk_error(chunk, route, sent)
                sent = True
                yield chunk
                if finished:
                    return
        finally:
            self._spawn(self._close(sub, attempt_id, abort=not finished))

    async def _chunk_error(self, chunk: TokenChunk, route: RouteReply, sent: bool) -> BackendError:
        """The error of a worker's error chunk: capacity (503 server_busy); a worker that says it is failing (its
        engine died: PeerFailed, retried before the first chunk); before the first chunk, a peer of the
        attempt that is gone (its death caused the error: PeerFailed, retried); else the worker's own (500: after
        the first chunk the sender is the streaming worker, alive since it sent this)."""
        if chunk.retryable and chunk.error_code:  # a named transient failure (the encoder tier is unavailable)
            return self.unavailable(chunk.error or chunk.error_code, code=chunk.error_code)
        if chunk.retryable:
            return self.unavailable(f"server is at capacity: {chunk.error}", code="server_busy")
        if chunk.instance_failed:  # the worker's engine died under it: as good as gone
            instance = chunk.instance_id or route.prefill_instance
            return PeerFailed(f"worker {instance} failed: {chunk.error}", instance, decode=_is_decode(route, instance))
        if sent:
            return BackendError(500, f"worker failed: {chunk.error}", code="worker_error")
        await asyncio.sleep(0.05)  # a peer's death can reach the worker a moment before NATS notices it
        for instance in sorted({route.prefill_instance, route.decode_instance}):
            try:
                await self._request(subjects.health(self.namespace, instance), HealthRequest(), HealthReply,
                                    self.config.liveness_interval_s, f"probing {instance}")
            except BusError as exc:
                return PeerFailed(f"worker {instance} is gone ({exc}); the request failed with: {chunk.error}",
                                  instance, decode=_is_decode(route, instance),
                                  unreachable=isinstance(exc, NoResponders))
        return BackendError(500, f"worker failed: {chunk.error}", code="worker_error")

    async def _submit(self, route: RouteReply, request_id: str, token_ids: list[int], sampling: WireSamplingParams,
                      stream: str, mm_items: Sequence[WireMMItem] = (), resume: Sequence[int] = ()) -> None:
        """Send the request to the prefill (or combined) worker and check its acknowledgement."""
        decode = route.decode_instance if route.decode_instance != route.prefill_instance else ""
        msg = GenerateRequest(request_id=request_id, token_ids=token_ids, sampling=sampling,
                              stream_subject=stream, decode_instance=decode, mm_items=list(mm_items),
                              resume_token_ids=list(resume))
        target = route.prefill_instance
        try:
            ack = await self._ack(target, msg)
        except NoResponders as exc:
            raise PeerFailed(f"worker {target} is not reachable (gone?)", target, unreachable=True) from exc
        except BusTimeout as exc:
            raise PeerFailed(f"worker {target} did not accept the request within "
                             f"{self.config.ack_timeout_s}s", target) from exc
        except RemoteError as exc:
            if exc.code is ErrorCode.UNAVAILABLE:
                raise PeerFailed(f"worker {target} refused the request: {exc.message}", target,
                                 code="worker_busy") from exc
            raise self.unavailable(f"worker {target} refused the request: {exc.message}") from exc
        except BusError as exc:
            raise self.unavailable(f"worker {target}: {exc}") from exc
        if ack.status == AckStatus.BUSY:  # draining: another instance takes it
            raise PeerFailed(ack.message or f"worker {target} is busy", target, code="worker_busy")
        if ack.status != AckStatus.ACCEPTED:
            status, code = _ACK_STATUS[ack.status]
            raise BackendError(status, ack.message or f"worker {target}: {ack.status.value}", code=code)

    async def _ack(self, target: str, msg: GenerateRequest) -> GenerateAck:
        """`target`'s GenerateAck within `ack_timeout_s`. While it is pending, the target's health is probed every
        `liveness_interval_s` (beside the wait, so a late ack is taken at once): `liveness_misses` probes in a
        row with no responders mean it died holding the request, and the attempt fails then (PeerFailed: retried
        elsewhere) instead of at the ack bound. A probe that times out (busy, or behind a hung NATS node) leaves
        the decision to the ack bound."""
        cfg = self.config
        ns = self.namespace
        ask = asyncio.ensure_future(self._request(subjects.generate(ns, target), msg, GenerateAck, cfg.ack_timeout_s,
                                                  f"sending the request to {target}"))
        misses = 0
        try:
            while True:
                await asyncio.wait({ask}, timeout=cfg.liveness_interval_s)
                if ask.done():
                    return ask.result()
                probe = asyncio.ensure_future(self._bus.request(subjects.health(ns, target), HealthRequest(),
                                                                HealthReply, cfg.liveness_interval_s))
                await asyncio.wait({ask, probe}, return_when=asyncio.FIRST_COMPLETED)
                if ask.done():
                    _discard(probe)
                    return ask.result()
                exc = probe.exception()
                if isinstance(exc, NoResponders) and self._bus.is_connected:
                    misses += 1
                    if misses >= cfg.liveness_misses:
                        raise PeerFailed(f"worker {target} is gone: it did not accept the request, and {misses} "
                                         "health probes in a row found nothing listening", target, unreachable=True)
                elif exc is None:
                    misses = 0
        finally:
            _discard(ask)

    async def _chunks(self, sub, request_id: str, watch: set[str], route: RouteReply) -> AsyncIterator[TokenChunk]:
        """The attempt's chunks in order. Core NATS may lose a message (a node that dies or hangs): chunks are
        numbered per sending worker (`TokenChunk.seq`), a gap or a silent liveness interval asks the worker for
        what it sent again (`StreamReplayRequest`), late duplicates are dropped, and chunks the worker no longer
        holds fail the attempt explicitly (never a silent hole or a wait for the idle bound)."""
        cfg = self.config
        last = time.monotonic()
        live = _Liveness()
        order = _StreamOrder()
        first = True
        while True:
            try:
                batch = [await sub.next(cfg.liveness_interval_s)]
            except BusTimeout:
                if time.monotonic() - last > cfg.idle_timeout_s:
                    raise self.unavailable(f"request {request_id}: no tokens for {cfg.idle_timeout_s}s") from None
                batch = await self._probe(watch, live, route, request_id, order)
            for chunk in batch:
                for ready in await self._in_order(chunk, order, request_id):
                    last = time.monotonic()
                    if first and ready.instance_id:
                        watch, first = {ready.instance_id}, False  # from now on only the streaming worker matters
                    yield ready

    async def _in_order(self, chunk: TokenChunk, order: _StreamOrder, request_id: str) -> list[TokenChunk]:
        """`chunk` and any chunks lost before it (fetched again from its sender), or [] for a duplicate."""
        if chunk.seq < 0 or not chunk.instance_id:
            return [chunk]  # unnumbered: taken as it comes
        expected = order.expected.get(chunk.instance_id, 0)
        if chunk.seq < expected:
            return []
        missing: list[TokenChunk] = []
        if chunk.seq > expected:
            metrics.STREAM_GAPS.inc()
            reply = await self._replay(chunk.instance_id, request_id, expected)
            missing = [c for c in (reply.chunks if reply is not None else []) if expected <= c.seq < chunk.seq]
            if [c.seq for c in missing] != list(range(expected, chunk.seq)):
                raise self.unavailable(
                    f"request {request_id}: chunks {expected}..{chunk.seq - 1} from {chunk.instance_id} were lost in "
                    "transit (a NATS node failed?) and the worker no longer holds them", code="stream_lost")
            metrics.STREAM_REPLAYED.inc(len(missing))
            log.warning("token chunks lost in transit, fetched again", extra={
                "request_id": request_id, "instance": chunk.instance_id, "chunks": len(missing), "on": "gap"})
        order.expected[chunk.instance_id] = chunk.seq + 1
        return [*missing, chunk]

    async def _ask_replay(self, instance: str, request_id: str, from_seq: int) -> StreamReplayReply:
        """One stream_replay request to `instance` (bus errors raised as they come)."""
        return await self._bus.request(subjects.stream_replay(self.namespace, instance),
                                       StreamReplayRequest(request_id=request_id, from_seq=from_seq),
                                       StreamReplayReply, self.config.liveness_interval_s)

    async def _replay(self, instance: str, request_id: str, from_seq: int) -> StreamReplayReply | None:
        """What `instance` sent for the request from `from_seq` on; None when it cannot be asked (no such
        subject: an older worker or a fake; silent). While NATS is unreachable (the very failure that loses
        chunks) it asks again until the reconnect bound."""
        deadline = time.monotonic() + self.config.reconnect_bound_s
        while True:
            try:
                return await self._ask_replay(instance, request_id, from_seq)
            except Exception:
                if self._bus.is_connected or not await self._reconnected(deadline):
                    return None

    async def _probe(self, instances: set[str], live: _Liveness, route: RouteReply, request_id: str,
                     order: _StreamOrder) -> list[TokenChunk]:
        """Probe the attempt's workers after a silent interval: a worker's stream replay (which proves it alive
        and returns what it sent that never arrived), or its health subject where it serves no replay. Raises
        PeerFailed for a worker that is gone."""
        misses = live.misses
        if not self._bus.is_connected:  # no probe can answer: not the workers' fault, until the reconnect bound
            now = time.monotonic()
            live.disconnected_since = live.disconnected_since or now
            if now - live.disconnected_since > self.config.reconnect_bound_s:
                raise self.unavailable(f"the control plane (NATS) is unreachable for over "
                                       f"{self.config.reconnect_bound_s}s; workers {sorted(instances)} cannot be "
                                       "reached", code="control_plane_unavailable")
            return []
        live.disconnected_since = None
        found: list[TokenChunk] = []
        for instance in sorted(instances):
            expected = order.expected.get(instance, 0)
            try:
                try:
                    reply = await self._ask_replay(instance, request_id, expected)
                except NoResponders:  # a worker without replay (a test's fake): its health subject
                    reply = None
                    await self._bus.request(subjects.health(self.namespace, instance), HealthRequest(),
                                            HealthReply, self.config.liveness_interval_s)
                misses[instance] = 0
                live.silent_since.pop(instance, None)
                live.unreachable_since.pop(instance, None)
            except Exception as exc:
                if not self._bus.is_connected:  # the probe died with the connection: NATS's outage, not the
                    live.disconnected_since = live.disconnected_since or time.monotonic()  # worker's (bound above)
                    return found
                if not isinstance(exc, BusError):
                    exc = BusError(f"probing {instance}: {exc!r}")
                misses[instance] = misses.get(instance, 0) + 1
                if isinstance(exc, BusTimeout):  # silent, not gone: maybe its NATS node hangs (it reconnects)
                    since = live.silent_since.setdefault(instance, time.monotonic() - self.config.liveness_interval_s)
                    if time.monotonic() - since < self.config.liveness_silent_s:
                        continue
                elif isinstance(exc, NoResponders):  # gone, or its client is moving to another NATS node (a
                    # node died: nats-py may pause 1 s before it reconnects): gone once that lasted the grace
                    since = live.unreachable_since.setdefault(instance, time.monotonic())
                    if time.monotonic() - since < self.config.unreachable_grace_s:
                        continue
                if misses[instance] >= self.config.liveness_misses:
                    raise PeerFailed(f"worker {instance} is gone ({misses[instance]} health probes failed, last: "
                                     f"{exc})", instance, decode=_is_decode(route, instance)) from exc
                continue
            if reply is None:
                continue
            if expected and not reply.known:
                raise self.unavailable(f"request {request_id}: {instance} no longer holds its stream (chunks from "
                                       f"{expected} on were lost in transit)", code="stream_lost")
            if reply.chunks:
                metrics.STREAM_GAPS.inc()
                metrics.STREAM_REPLAYED.inc(len(reply.chunks))
                log.warning("token chunks lost in transit, fetched again", extra={
                    "request_id": request_id, "instance": instance, "chunks": len(reply.chunks), "on": "silence"})
                found.extend(reply.chunks)
        return found

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def _close(self, sub, request_id: str, abort: bool) -> None:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if abort:
            try:
                await self._bus.publish(subjects.abort(self.namespace),
                                        AbortRequest(request_id=request_id, reason="client left or attempt failed"))
            except Exception as exc:
                log.warning("could not publish abort", extra={"request_id": request_id, "error": repr(exc)})

    async def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for pending cleanups, so aborts go out before the bus closes."""
        if self._cleanup:
            await asyncio.wait(set(self._cleanup), timeout=timeout)


def _is_decode(route: RouteReply, instance: str) -> bool:
    """Is `instance` the attempt's separate decode worker (not its prefill or combined worker)?"""
    return instance == route.decode_instance and instance != route.prefill_instance


def _migrated_usage(chunk: TokenChunk, prompt_tokens: int, resumed: int) -> TokenChunk:
    """The final chunk of a migrated stream: count how much of the prefix it continued from (prompt + `resumed`
    tokens sent) the new worker loaded from a cache; the client's `cached_tokens` stays within the prompt."""
    usage = chunk.usage
    assert usage is not None
    loaded = min(usage.cached_tokens, prompt_tokens + resumed)
    metrics.MIGRATED_PREFIX.inc(prompt_tokens + resumed)
    metrics.MIGRATED_PREFIX_LOADED.inc(loaded)
    return chunk.model_copy(update={"usage": usage.model_copy(update={"cached_tokens": min(loaded, prompt_tokens)})})
