"""The KV-affinity policy (pure): pick the worker whose predicted hit and load give the request the least work
ahead of its first token, from the `ClusterPrefixIndex` prediction and the registry load.

A prefill candidate costs the tokens it still computes, plus partial cost for host-tier hits, queued prefill
tokens (registry load and this router's recent picks) and running requests; a decode candidate costs the
tokens to transfer plus its running requests (`AffinityWeights`). Candidates are the workers serving the
request's bucket in uncached tokens. Ties go to an xxhash tie-break; `temperature` > 0 samples from the
costs with a draw seeded by the request id, so every router replica picks the same. Formula:
docs/routing.md, "The KV-affinity cost".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from libs.buckets import DEFAULT_BUCKET_EDGES, LengthBuckets
from libs.routing.choice import avoiding, tie_break
from libs.routing.index import NO_HIT, PredictedHit
from libs.routing.instance import Instance
from libs.routing.recent import RecentPicks, snapshots
from libs.routing.router import Fleet, Route


@dataclass(frozen=True)
class AffinityWeights:
    host_penalty: float = 0.25
    """Cost of a host-tier token as a share of computing it."""
    queue_weight: float = 0.5
    """Per prefill token queued ahead on the worker. Below 1: a request sent away from its cache adds its
    recomputed prefix to the cluster's work, not only to its own wait (bench.router: 0.5 lifts the agentic
    trace's hit ratio from 0.77 to 0.91 of the pooled oracle at N = 16 and cuts its TTFT p50 4x)."""
    decode_weight: float = 64.0
    """Per request running there (its decode steps share the worker's forward passes)."""
    transfer_weight: float = 0.05
    """Decode side: per token whose KV must be shipped from the prefill worker."""
    temperature: float = 0.0
    """0: argmin; > 0: softmax sampling over normalised costs (deterministic per request id)."""
    credit: str = "valid"
    """"valid": the SWA-valid hit `match` returns; "raw": the raw full-KV overlap (SWA-blind, for comparison)."""

    def __post_init__(self) -> None:
        if min(self.host_penalty, self.queue_weight, self.decode_weight, self.transfer_weight,
               self.temperature) < 0:
            raise ValueError("AffinityWeights must be >= 0")
        if self.credit not in ("valid", "raw"):
            raise ValueError(f"AffinityWeights.credit must be 'valid' or 'raw', got {self.credit!r}")


def credited(hit: PredictedHit, num_tokens: int, credit: str, page_size: int) -> PredictedHit:
    """The hit the cost credits: the predicted one, or (credit "raw") the raw overlap as if it were valid
    (capped like `match`: at least one token is left to compute)."""
    if credit == "valid":
        return hit
    raw = min(hit.raw_tokens, (num_tokens - 1) // page_size * page_size)
    return PredictedHit(raw, raw, hit.raw_tokens, 0)


def prefill_cost(inst: Instance, num_tokens: int, hit: PredictedHit, w: AffinityWeights, recent_tokens: int = 0
                 ) -> float:
    return (num_tokens - hit.tokens + w.host_penalty * hit.host_tokens
            + w.queue_weight * (inst.prefill_tokens_queued + recent_tokens) + w.decode_weight * inst.running)


def decode_cost(inst: Instance, num_tokens: int, hit: PredictedHit, w: AffinityWeights, recent: int = 0) -> float:
    """`recent`: this router's (and its replicas') picks of the worker its load does not hold yet."""
    return w.transfer_weight * (num_tokens - hit.tokens) + w.decode_weight * (inst.running + recent)


def choose(costs: Mapping[str, float], request_id: str, temperature: float = 0.0, scale: float = 1.0) -> str:
    """Lowest cost (ties: xxhash tie-break), or with `temperature` a softmax sample over (cost - min) / scale,
    its uniform drawn from xxhash64 of the request id (deterministic, same in every replica)."""
    order = sorted(costs, key=lambda i: (costs[i], tie_break(request_id, i)))
    if temperature <= 0 or len(order) == 1:
        return order[0]
    lo = costs[order[0]]
    weights = [math.exp(-(costs[i] - lo) / max(scale, 1e-9) / temperature) for i in order]
    u = xxhash.xxh64_intdigest(f"softmax/{request_id}".encode()) / 2.0**64 * sum(weights)
    for i, wt in zip(order, weights, strict=True):
        u -= wt
        if u < 0:
            return i
    return order[-1]


class HitPredictor(Protocol):
    """What the cost needs of an index: `ClusterPrefixIndex` (fed by the workers' events) or `ApproxIndex`
    (this router's own decisions)."""

    @property
    def page_size(self) -> int: ...

    def predict(self, block_hashes: Sequence[int], num_tokens: int, rebuild: bool = True
                ) -> dict[str, PredictedHit]: ...

    def predict_both(self, block_hashes: Sequence[int], num_tokens: int
                     ) -> tuple[dict[str, PredictedHit], dict[str, PredictedHit]]:
        """(`predict` with rebuild hits, without them), from one walk of the chain."""
        ...


class AffinityRouter:
    """`Router.route`'s call with the KV-affinity policy: the index predicts every worker's hit, the cost
    above picks. The caller feeds `index` the workers' events and removes workers that leave; it may replace
    `index` (e.g. once the workers' KV layout is known)."""

    def __init__(self, index: HitPredictor, bucket_edges: Sequence[int] = DEFAULT_BUCKET_EDGES,
                 weights: AffinityWeights | None = None, recent_window_s: float = 2.0) -> None:
        self.index = index
        self.buckets = LengthBuckets(tuple(bucket_edges))
        self.weights = weights or AffinityWeights()
        self.recent = RecentPicks(recent_window_s)  # weights: predicted prefill tokens of the picks
        self.recent_decodes = RecentPicks(recent_window_s)  # disaggregated decode picks (one per request)

    def route(self, fleet: Fleet, request_id: str, num_tokens: int, now: float,
              exclude_decodes: Sequence[str] = (), block_hashes: Sequence[int] = (),
              exclude_instances: Sequence[str] = ()) -> Route:
        """As `Router.route`. A request with `exclude_decodes` is a prefill asking again for another decode
        worker: its prefill pick stands and is not counted again, and its picks of the excluded decode workers
        (which refused it) no longer count on them."""
        self.recent_decodes.drop(request_id, exclude_decodes)
        if fleet.disaggregated:
            prefills = avoiding(fleet.prefills, exclude_instances, "prefill worker")
            decodes = [d for d in fleet.decodes if d.address and d.instance_id not in exclude_decodes]
            if not decodes:
                raise LookupError("no live decode worker with a KV transfer address in the registry"
                                  + (f" besides {sorted(exclude_decodes)}" if exclude_decodes else ""))
        elif fleet.workers:
            prefills, decodes = avoiding(fleet.workers, exclude_instances, "worker"), []
        else:
            raise LookupError("no live worker in the registry" if not fleet.prefills and not fleet.decodes else
                              "disaggregated mode needs prefill and decode workers")
        hits: Mapping[str, PredictedHit] = {}
        dhits: Mapping[str, PredictedHit] = {}
        if block_hashes and decodes:  # decode never takes a rebuild hit: both predictions, one walk
            hits, dhits = self.index.predict_both(block_hashes, num_tokens)
        elif block_hashes:
            hits = self.index.predict(block_hashes, num_tokens)
        prefill, hit = self._pick_prefill(prefills, request_id, num_tokens, hits, now, record=not exclude_decodes)
        if not decodes:
            return Route(prefill, prefill, predicted_hit=hit.tokens)
        recent = self.recent_decodes.counts(now, snapshots(decodes), skip_request=request_id)
        costs = {d.instance_id: decode_cost(d, num_tokens, dhits.get(d.instance_id, NO_HIT), self.weights,
                                            recent.get(d.instance_id, 0))
                 for d in decodes}
        decode = choose(costs, request_id, self.weights.temperature, max(1, num_tokens))
        self.recent_decodes.add(decode, now, request_id=request_id)
        return Route(prefill, decode, predicted_hit=hit.tokens,
                     predicted_decode_hit=dhits.get(decode, NO_HIT).tokens)

    def note_pick(self, request_id: str, prefill: str, decode: str, at: float, prefill_tokens: int) -> None:
        """A replica's pick (`RoutePick`): its predicted prefill tokens count on `prefill` like this router's
        own picks, and its decode pick on `decode` (disaggregated), so a burst split over replicas spreads."""
        self.recent.add(prefill, at, max(1, prefill_tokens), request_id)
        if decode != prefill:
            self.recent_decodes.add(decode, at, request_id=request_id)

    def _pick_prefill(self, instances: Sequence[Instance], request_id: str, num_tokens: int,
                      hits: Mapping[str, PredictedHit], now: float, record: bool = True) -> tuple[str, PredictedHit]:
        w, P = self.weights, self.index.page_size
        recent = self.recent.counts(now, snapshots(instances), skip_request=request_id)
        credit = {i.instance_id: credited(hits.get(i.instance_id, NO_HIT), num_tokens, w.credit, P)
                  for i in instances}
        fits = [i for i in instances
                if not i.buckets or self.buckets.classify(num_tokens - credit[i.instance_id].tokens) in i.buckets]
        costs = {i.instance_id: prefill_cost(i, num_tokens, credit[i.instance_id], w, recent.get(i.instance_id, 0))
                 for i in fits or instances}
        pick = choose(costs, request_id, w.temperature, max(1, num_tokens))
        if record:
            self.recent.add(pick, now, max(1, num_tokens - credit[pick].tokens), request_id)
        return pick, credit[pick]
