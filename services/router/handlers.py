"""Logic of the router service (pure where possible)."""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from libs.engine.buckets import LengthBuckets
from protos.messages import RegistryEntry
from services.router.config import RouterConfig


def health_details(config: RouterConfig) -> dict[str, str]:
    """Extra health fields: which model is configured and whether serving handlers exist yet."""
    return {"model": config.model or "none", "serving": "not yet"}


def _load(entry: RegistryEntry) -> tuple[int, float]:
    """Queue depth first, then the share of the full KV pool in use (entries without load count as idle)."""
    load = entry.load
    if load is None:
        return 0, 0.0
    return load.running + load.waiting, load.kv_full_used / max(1, load.kv_full_total)


def pick_worker(workers: Sequence[RegistryEntry], num_tokens: int, bucket_edges: Sequence[int],
                request_id: str) -> RegistryEntry:
    """Aggregated mode: the least-loaded live worker that serves the request's length bucket.

    Workers advertising no buckets serve all; when no worker serves the bucket, every worker is a
    candidate (a misrouted request still gets served). Ties are broken by an xxhash of
    (request id, instance id) so that a burst between two load refreshes spreads over equally idle
    workers instead of piling onto the first one, yet the choice stays deterministic.
    The bucket uses the raw prompt length: without the KV-affinity index the router cannot know the
    cached part.
    """
    if not workers:
        raise LookupError("no live worker in the registry")
    bucket = LengthBuckets(tuple(bucket_edges)).classify(num_tokens)
    serving = [w for w in workers if not w.buckets or bucket in w.buckets] or list(workers)
    return min(serving, key=lambda w: (_load(w), xxhash.xxh64_intdigest(f"{request_id}/{w.instance_id}")))
