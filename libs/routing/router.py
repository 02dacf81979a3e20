"""One router's decision (pure): which topology the live fleet forms, the pick for it, and the bookkeeping
of recent picks (its own and its replicas'). The router service keeps the registry view, builds a `Fleet`
and asks `Router.route` (least-loaded policy) or `AffinityRouter.route` (KV affinity): same call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from libs.buckets import DEFAULT_BUCKET_EDGES, LengthBuckets
from libs.routing.choice import pick_pair, pick_worker
from libs.routing.instance import Instance
from libs.routing.recent import RecentPicks, snapshots


@dataclass(frozen=True)
class Fleet:
    """The live instances a request can be routed to, by role."""

    prefills: tuple[Instance, ...] = ()
    decodes: tuple[Instance, ...] = ()
    workers: tuple[Instance, ...] = ()
    """Combined (prefill + decode) workers."""

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode workers are both live: requests go to a pair (combined workers are unused)."""
        return bool(self.prefills and self.decodes)

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes or self.workers)


@dataclass(frozen=True)
class Route:
    """Where a request runs; prefill == decode in aggregated mode (one worker does both)."""

    prefill: str
    decode: str
    predicted_hit: int = 0
    """Tokens the prefill (or combined) worker is predicted to skip (KV-affinity policy; 0 otherwise)."""
    predicted_decode_hit: int = 0
    """Disaggregated: tokens the decode worker already holds (pages not shipped)."""


class Router:
    """The routing state of one router process: its bucket edges and its recent picks."""

    def __init__(self, bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES, recent_window_s: float = 2.0) -> None:
        self.buckets = LengthBuckets(tuple(bucket_edges))
        self.recent = RecentPicks(recent_window_s)

    def route(self, fleet: Fleet, request_id: str, num_tokens: int, now: float,
              exclude_decodes: Sequence[str] = (), block_hashes: Sequence[int] = (),
              exclude_instances: Sequence[str] = ()) -> Route:
        """The least-loaded policy (`block_hashes` unused: the KV-affinity policy, `AffinityRouter`, takes the
        same call). Disaggregated when prefill and decode workers are live, else aggregated over combined workers;
        `exclude_instances` are prefill / combined workers not to use. `now` is unix time: the workers stamp
        their load snapshots with it. Raises LookupError when the fleet cannot serve the request."""
        if fleet.disaggregated:
            return self._route_pair(fleet, request_id, num_tokens, now, exclude_decodes, exclude_instances)
        if not fleet.workers and (fleet.prefills or fleet.decodes):
            raise LookupError(f"disaggregated mode needs prefill and decode workers; live: "
                              f"{len(fleet.prefills)} prefill, {len(fleet.decodes)} decode")
        worker = pick_worker(fleet.workers, num_tokens, self.buckets, request_id, exclude_instances)
        return Route(prefill=worker.instance_id, decode=worker.instance_id)

    def note_pick(self, request_id: str, prefill: str, decode: str, at: float, prefill_tokens: int = 0) -> None:
        """A replica's pick (`RoutePick`): counted like this router's own (disaggregated picks count requests;
        `prefill_tokens` is the affinity policy's weight, unused here)."""
        self.recent.add(prefill, at, request_id=request_id)
        if decode != prefill:
            self.recent.add(decode, at, request_id=request_id)

    def _route_pair(self, fleet: Fleet, request_id: str, num_tokens: int, now: float,
                    exclude_decodes: Sequence[str], exclude_instances: Sequence[str]) -> Route:
        reflected = snapshots((*fleet.prefills, *fleet.decodes, *fleet.workers))
        prefill, decode = pick_pair(fleet.prefills, fleet.decodes, num_tokens, self.buckets, request_id,
                                    self.recent.counts(now, reflected, skip_request=request_id), exclude_decodes,
                                    exclude_instances)
        if not exclude_decodes:  # (a prefill asking again for a decode worker: its own pick stands)
            self.recent.add(prefill.instance_id, now, request_id=request_id)
        self.recent.drop(request_id, exclude_decodes)  # the decode workers that refused it never get it
        self.recent.add(decode.instance_id, now, request_id=request_id)
        return Route(prefill=prefill.instance_id, decode=decode.instance_id)
