"""Worker choice (pure): the least-loaded instance serving a request's length bucket, and (prefill, decode)
pairs for the disaggregated topology. Same inputs, same pick: ties are broken by a deterministic hash."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import xxhash

from libs.buckets import LengthBuckets
from libs.routing.instance import Instance


def tie_break(request_id: str, instance_id: str) -> int:
    """Order among equally loaded instances: xxhash64 of "<request id>/<instance id>". A burst between two
    load refreshes spreads over equal workers instead of piling onto the first one, yet every router (and
    every run) picks the same for the same request; `hash()` is salted per process, so never that."""
    return xxhash.xxh64_intdigest(f"{request_id}/{instance_id}".encode())


def cost(instance: Instance, recent: Mapping[str, int]) -> tuple[int, float]:
    """Queue first (running + waiting + this router's recent picks not yet in the load), then KV share."""
    return instance.queue + recent.get(instance.instance_id, 0), instance.kv_share


def serving(instances: Sequence[Instance], bucket: int) -> list[Instance]:
    """The instances meant for `bucket` (those advertising no buckets serve all); every instance when none
    is, so a request of an unserved length still gets served."""
    return [i for i in instances if not i.buckets or bucket in i.buckets] or list(instances)


def least_loaded(candidates: Sequence[Instance], request_id: str,
                 recent: Mapping[str, int] | None = None) -> Instance:
    """The lowest `cost`, ties broken by `tie_break`; candidates must not be empty."""
    recent = recent or {}
    return min(candidates, key=lambda i: (cost(i, recent), tie_break(request_id, i.instance_id)))


def avoiding(instances: Sequence[Instance], exclude: Sequence[str], what: str) -> list[Instance]:
    """`instances` minus the excluded ids (workers that failed or refused the request); LookupError naming
    both when nothing is left."""
    if not instances:
        raise LookupError(f"no live {what} in the registry")
    left = [i for i in instances if i.instance_id not in exclude]
    if not left:
        raise LookupError(f"no live {what} in the registry besides {sorted(exclude)}")
    return left


def pick_worker(workers: Sequence[Instance], num_tokens: int, buckets: LengthBuckets,
                request_id: str, exclude_instances: Sequence[str] = ()) -> Instance:
    """Aggregated mode: the least-loaded live worker that serves the request's length bucket, other than
    `exclude_instances` (those that failed or refused this request).

    The bucket uses the raw prompt length: without the KV-affinity index the router cannot know the
    cached part.
    """
    candidates = avoiding(workers, exclude_instances, "worker")
    return least_loaded(serving(candidates, buckets.classify(num_tokens)), request_id)


def pick_pair(prefills: Sequence[Instance], decodes: Sequence[Instance], num_tokens: int, buckets: LengthBuckets,
              request_id: str, recent: Mapping[str, int] | None = None, exclude_decodes: Sequence[str] = (),
              exclude_instances: Sequence[str] = ()) -> tuple[Instance, Instance]:
    """Disaggregated mode: (prefill, decode) for one request, by length bucket and load.

    Prefill: the least loaded (`cost`, with this router's `recent` picks) among workers serving the
    request's length bucket (all when none does). Decode: the same cost over every decode worker (decode
    work per token does not depend on the prompt's bucket; its KV does, which the KV share term covers).
    Decode workers without a transfer address cannot receive KV and are skipped, and so are
    `exclude_decodes` (they refused this request as full: a prefill asks again for another), and prefill
    workers in `exclude_instances` (they failed or refused it: the gateway retries elsewhere).
    """
    prefills = avoiding(prefills, exclude_instances, "prefill worker")
    receivers = [d for d in decodes if d.address and d.instance_id not in exclude_decodes]
    if not receivers:
        raise LookupError("no live decode worker with a KV transfer address in the registry"
                          + (f" besides {sorted(exclude_decodes)}" if exclude_decodes else ""))
    prefill = least_loaded(serving(prefills, buckets.classify(num_tokens)), request_id, recent)
    return prefill, least_loaded(receivers, request_id, recent)
