"""Wiring of the router service: answers `windserve.<ns>.route` (queue group `router`) and its own
`windserve.<ns>.router.<id>.route` (the gateway asks replicas by name) from a local registry view and the
cluster's prefix index (docs/routing.md, "The router service").

Subscriptions: `kv_events.*` (plain: every replica indexes every worker), `route_picks` (the replicas' picks,
counted as load), `kv_hits` (the workers' actual hits, matched with this router's predictions). Requests out:
`kv_snapshot` to a worker whose view is stale, never on the request path. The choice itself is pure
(`libs.routing`): `AffinityRouter` (policy "affinity") or the least-loaded `Router`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel

from libs.bus import RegistryView, Unavailable, ViewConfig
from libs.routing import AffinityRouter, Fleet, Route, Router
from libs.service import Service
from protos import subjects
from protos.messages import (
    KVEventBatch,
    KVHitReport,
    KVSnapshotReply,
    KVSnapshotRequest,
    Role,
    RoutePick,
    RouteReply,
    RouteRequest,
)
from services.router import handlers, metrics
from services.router.config import RouterConfig
from services.router.kvsync import IndexSync

log = logging.getLogger("windserve.router")

_ROUTE_RESYNC_S = 0.5  # most time a request waits for that listing
_COLD_RESYNC_S = 1.0  # a view with no candidate lists the registry at most this often (it may lag the store)


class RouterService(Service):
    role = Role.ROUTER
    config: RouterConfig

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.sync = IndexSync(config, self._fetch_snapshot)
        self.policy: AffinityRouter | Router = (
            AffinityRouter(self.sync.predictor, config.buckets.bucket_edges, config.weights(), config.recent_window_s)
            if config.policy == "affinity" else Router(config.buckets.bucket_edges, config.recent_window_s))
        self.predictions = handlers.Predictions(config.predictions_max, config.predictions_ttl_s)
        self.view: RegistryView | None = None
        self.remote_picks = 0
        """Other replicas' picks counted so far."""
        self.hit_reports = 0
        """Hit reports received (any router's requests)."""

    @property
    def router_id(self) -> str:
        return self.config.instance_id

    # ------------------------------------------------------------------ lifecycle

    async def setup(self) -> None:
        assert self.bus is not None and self.registry is not None
        ns = self.config.namespace
        if self.config.kv_index:  # before the view: a worker's events after its join are never missed
            await self._consume(subjects.kv_events_all(ns), KVEventBatch, self.sync.on_batch, "kv-events")
        await self._consume(subjects.route_picks(ns), RoutePick, self._on_pick, "route-picks")
        await self._consume(subjects.kv_hits(ns), KVHitReport, self._on_hit, "kv-hits")
        self.view = RegistryView(self.registry, config=ViewConfig(list_timeout_s=self.config.registry_timeout_s,
                                                                  resync_interval_s=self.config.registry_resync_s),
                                 outages=self.registry_outages)  # (registered after setup: read when judged)
        self.view.add_listener(self.sync.on_registry)
        await self.view.start()  # every registered worker joins: each is asked for a snapshot
        if self.config.kv_index:
            self.spawn(self._snapshot_loop(), name="kv-snapshots")
        self.spawn(self._maintain_loop(), name="kv-index-maintenance")
        await self.bus.serve(subjects.route(ns), RouteRequest, self.route, queue=subjects.ROUTER_QUEUE)
        # addressed to this replica: a gateway whose first router did not answer in time asks another by name
        await self.bus.serve(subjects.router_route(ns, self.router_id), RouteRequest, self.route)

    async def teardown(self) -> None:
        if self.view is not None:
            await self.view.stop()

    def health_details(self) -> dict[str, str]:
        return {**handlers.health_details(self.config), **self.sync.details()}

    # ------------------------------------------------------------------ routing

    async def route(self, req: RouteRequest) -> RouteReply:
        """Answer one `RouteRequest` (the handler of the route subject; tests call it on one replica)."""
        assert self.view is not None
        start = time.perf_counter()
        now = time.time()  # the workers stamp their load snapshots with unix time
        try:
            try:
                decided = self._decide(req, handlers.fleet_of(self.view.live(now)), now)
            except LookupError:
                # no candidate in the view: list the store (at most every _COLD_RESYNC_S) in case the view lags
                # it (a join the watch has not shown yet, a watch that went quiet), then decide once more
                if not await self._resync_on_the_request_path():
                    raise
                decided = self._decide(req, handlers.fleet_of(self.view.live(now)), now)
        except LookupError as exc:
            metrics.DECISIONS.labels(self.config.policy, "no_candidate").inc()
            raise Unavailable(f"no worker for request {req.request_id}: {exc}") from exc
        metrics.DECISIONS.labels(self.config.policy, "ok").inc()
        metrics.DECISION_SECONDS.observe(time.perf_counter() - start)
        if not req.exclude_decodes:  # (a prefill asking again for a decode worker: its prefill pick stands)
            self.predictions.add(req.request_id, now, decided.prefill, decided.predicted_hit, decided.decode,
                                 decided.predicted_decode_hit)
            await self._share(req, decided, now)
        return RouteReply(prefill_instance=decided.prefill, decode_instance=decided.decode,
                          predicted_hit_tokens=decided.predicted_hit,
                          predicted_decode_hit_tokens=decided.predicted_decode_hit)

    async def _resync_on_the_request_path(self) -> bool:
        """A listing for a request that found no candidate: skipped while one is in flight (the registry may be
        electing a leader: that listing waits its whole bound) and cut at _ROUTE_RESYNC_S, so the request is
        answered well within the gateway's route timeout. False when nothing was listed."""
        assert self.view is not None
        if self.view.listing:
            return False
        try:
            async with asyncio.timeout(_ROUTE_RESYNC_S):
                return await self.view.resync_if_older(_COLD_RESYNC_S)
        except TimeoutError:
            return False

    def _decide(self, req: RouteRequest, fleet: Fleet, now: float) -> Route:
        """The pure decision, on the index as it is now (no await inside: events cannot interleave)."""
        predictor = self.sync.predictor
        self.sync.expire(now)
        if isinstance(self.policy, AffinityRouter):
            self.policy.index = predictor
        route = self.policy.route(fleet, req.request_id, req.num_tokens, now, exclude_decodes=req.exclude_decodes,
                                  block_hashes=req.block_hashes, exclude_instances=req.exclude_instances)
        if isinstance(self.policy, Router) and req.block_hashes:  # least-loaded: still say what it will hit
            hits, dhits = predictor.predict_both(req.block_hashes, req.num_tokens)
            route = Route(route.prefill, route.decode, hits[route.prefill].tokens if route.prefill in hits else 0,
                          dhits[route.decode].tokens if route.decode != route.prefill and route.decode in dhits else 0)
        if not req.exclude_decodes:
            self.sync.record((route.prefill, route.decode), req.block_hashes, now)
        return route

    async def _share(self, req: RouteRequest, route: Route, now: float) -> None:
        """Tell the replicas (before the reply goes out, so the next request they answer likely counts it)."""
        assert self.bus is not None
        pick = RoutePick(router_id=self.router_id, request_id=req.request_id, prefill_instance=route.prefill,
                         decode_instance=route.decode, prefill_tokens=max(1, req.num_tokens - route.predicted_hit),
                         at=now, block_hashes=req.block_hashes if self.sync.approx is not None else [])
        try:
            await self.bus.publish(subjects.route_picks(self.config.namespace), pick)
        except Exception as exc:  # the replicas miss one pick: never fail the route for it
            log.warning("could not share a route pick", extra={"request_id": req.request_id, "error": repr(exc)})

    # ------------------------------------------------------------------ subscriptions

    def _on_pick(self, pick: RoutePick) -> None:
        if pick.router_id == self.router_id:
            return
        self.policy.note_pick(pick.request_id, pick.prefill_instance, pick.decode_instance, pick.at,
                              pick.prefill_tokens)
        # approximate mode: a follow-up the queue group hands to this replica predicts the other's decision
        self.sync.record((pick.prefill_instance, pick.decode_instance), pick.block_hashes, pick.at)
        self.remote_picks += 1
        metrics.REMOTE_PICKS.inc()

    def _on_hit(self, report: KVHitReport) -> None:
        self.hit_reports += 1
        pred = self.predictions.take(report.request_id, report.instance_id, time.time())
        if pred is None:
            metrics.HIT_REPORTS.labels("unmatched").inc()  # another replica's request, or expired
            return
        metrics.HIT_REPORTS.labels("matched").inc()
        metrics.PREDICTED_HIT_TOKENS.labels(pred.side).inc(pred.tokens)
        metrics.ACTUAL_HIT_TOKENS.labels(pred.side).inc(report.cached_tokens)
        metrics.MISPREDICTED_TOKENS.labels(pred.side).inc(max(0, pred.tokens - report.cached_tokens))
        if pred.tokens > report.cached_tokens:
            log.info("hit mispredicted", extra={"request_id": report.request_id, "instance": report.instance_id,
                                                "predicted": pred.tokens, "actual": report.cached_tokens})

    async def _consume(self, subject: str, model: type[BaseModel], handle: Callable[[Any], object],
                       name: str) -> None:
        """Subscribe now (nothing published after this returns is missed); handle each message in a task."""
        assert self.bus is not None
        sub = await self.bus.subscribe(subject, model)
        self.spawn(_each(sub, handle, name), name=name)

    async def _fetch_snapshot(self, instance_id: str) -> KVSnapshotReply:
        assert self.bus is not None
        return await self.bus.request(subjects.kv_snapshot(self.config.namespace, instance_id),
                                      KVSnapshotRequest(router_id=self.router_id), KVSnapshotReply,
                                      timeout=self.config.snapshot_timeout_s)

    # ------------------------------------------------------------------ background

    async def _snapshot_loop(self) -> None:
        while True:
            await self.sync.fetch_due()
            wait = self.sync.next_due_in()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0 if wait is None else min(wait, 1.0)):
                    await self.sync.wake.wait()

    async def _maintain_loop(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(self.config.maintain_interval_s)
            await self.sync.maintain(measure=ticks % 30 == 0)  # the byte count walks every block: rarely
            ticks += 1


async def _each(sub: AsyncIterator[Any], handle: Callable[[Any], object], name: str) -> None:
    """Feed every message to `handle`; one that raises is logged and skipped (the stream goes on)."""
    try:
        async for msg in sub:
            try:
                handle(msg)
            except Exception:
                log.exception("message handler failed", extra={"subscription": name})
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()  # type: ignore[attr-defined]
