"""windserve routing (pure: ints, ids, dataclasses; no IO, torch or wire models).

    router = Router(bucket_edges=(4096, 65536))
    route = router.route(Fleet(prefills=..., decodes=...), request_id, num_tokens, now=time.time())

- `instance`: `Instance`, the routing view of a registry entry (`instance_of` builds it);
- `choice`: `pick_worker` (aggregated), `pick_pair` (disaggregated), their cost and xxhash `tie_break`;
- `recent`: `RecentPicks`, this router's picks not yet reflected in the registry load;
- `router`: `Router.route`, the least-loaded topology decision over a `Fleet`;
- `index`: `ClusterPrefixIndex` (predicts each worker's `KVCache.match` from its `KVEvent`s), `KVSnapshot`;
- `affinity`: `AffinityRouter`, the KV-affinity policy (same `route` call);
- `approx`: `ApproxIndex`, a prefix index of the router's own decisions (same `predict` call).

Length buckets come from `libs.buckets`. The router service and the gateway's no-router fallback both
choose through here (docs/routing.md).
"""

from libs.buckets import DEFAULT_BUCKET_EDGES, LengthBuckets
from libs.routing.affinity import (
    AffinityRouter,
    AffinityWeights,
    HitPredictor,
    choose,
    decode_cost,
    prefill_cost,
)
from libs.routing.approx import ApproxIndex
from libs.routing.choice import cost, least_loaded, pick_pair, pick_worker, serving, tie_break
from libs.routing.index import NO_HIT, BlockState, ClusterPrefixIndex, KVSnapshot, PredictedHit
from libs.routing.instance import EntryLike, Instance, instance_of
from libs.routing.recent import RecentPicks, Reflected
from libs.routing.router import Fleet, Route, Router

__all__ = [
    "NO_HIT", "AffinityRouter", "AffinityWeights", "ApproxIndex", "BlockState", "HitPredictor", "KVSnapshot",
    "PredictedHit", "ClusterPrefixIndex",
    "choose", "decode_cost", "prefill_cost",
    "DEFAULT_BUCKET_EDGES", "EntryLike", "Fleet", "Instance", "LengthBuckets", "RecentPicks", "Reflected", "Route",
    "Router",
    "cost", "instance_of", "least_loaded", "pick_pair", "pick_worker", "serving", "tie_break",
]
