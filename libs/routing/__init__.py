"""windserve routing (pure: ints, ids, dataclasses; no IO, torch or wire models).

    router = Router(bucket_edges=(4096, 65536))
    route = router.route(Fleet(prefills=..., decodes=...), request_id, num_tokens, now=time.time())

- `buckets`: `LengthBuckets` (also the engine scheduler's) and `DEFAULT_BUCKET_EDGES`, the one default of
  every `bucket_edges` setting;
- `instance`: `Instance`, the routing view of a registry entry (`instance_of` builds it);
- `choice`: `pick_worker` (aggregated), `pick_pair` (disaggregated), their cost and xxhash `tie_break`;
- `recent`: `RecentPicks`, this router's picks not yet reflected in the registry load;
- `router`: `Router.route`, the topology decision over a `Fleet` plus the recent-pick bookkeeping.

The router service and the gateway's no-router fallback both choose through here (docs/routing.md); the
KV-affinity index (the routing issue after #10) belongs here too.
"""

from libs.routing.buckets import DEFAULT_BUCKET_EDGES, LengthBuckets
from libs.routing.choice import cost, least_loaded, pick_pair, pick_worker, serving, tie_break
from libs.routing.instance import EntryLike, Instance, instance_of
from libs.routing.recent import RecentPicks
from libs.routing.router import Fleet, Route, Router

__all__ = [
    "DEFAULT_BUCKET_EDGES", "EntryLike", "Fleet", "Instance", "LengthBuckets", "RecentPicks", "Route", "Router",
    "cost", "instance_of", "least_loaded", "pick_pair", "pick_worker", "serving", "tie_break",
]
