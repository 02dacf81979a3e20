"""Logic of the router service (pure where possible)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import xxhash

from libs.engine.buckets import LengthBuckets
from protos.messages import RegistryEntry
from services.router.config import RouterConfig


def health_details(config: RouterConfig) -> dict[str, str]:
    """Extra health fields."""
    return {"bucket_edges": ",".join(map(str, config.bucket_edges))}


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
    return min(serving, key=lambda w: (_load(w), xxhash.xxh64_intdigest(f"{request_id}/{w.instance_id}".encode())))


# --- disaggregated mode: (prefill, decode) pairs ------------------------------------------------------------


class RecentPicks:
    """Picks this router made in the last `window_s` seconds, per instance (unix time).

    Registry load is refreshed every heartbeat, so a burst of requests between two refreshes would all see
    the same "least loaded" worker; counting our own recent picks on top of the advertised load spreads
    the burst (the pitfall of several routers choosing the same best worker from stale load is reduced,
    not removed: each router only knows its own picks). A pick made before the instance's load snapshot
    is already in that load and is not counted again: counting it twice made a worker whose load had just
    been refreshed look busier than one whose load had not, and sent a burst to the stale one."""

    def __init__(self, window_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ValueError(f"RecentPicks.window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._picks: dict[str, list[float]] = {}

    def add(self, instance_id: str, now: float) -> None:
        self._picks.setdefault(instance_id, []).append(now)

    def counts(self, now: float, reflected: Mapping[str, float] | None = None) -> dict[str, int]:
        """Picks per instance in the last window_s seconds, leaving out those made before `reflected[id]`
        (the time of the instance's load snapshot, which already counts them)."""
        cutoff = now - self.window_s
        reflected = reflected or {}
        for iid in list(self._picks):
            kept = [t for t in self._picks[iid] if t > cutoff]
            if kept:
                self._picks[iid] = kept
            else:
                del self._picks[iid]
        return {iid: n for iid, ts in self._picks.items()
                if (n := sum(1 for t in ts if t > reflected.get(iid, cutoff)))}


def _pair_cost(entry: RegistryEntry, recent: Mapping[str, int]) -> tuple[int, float]:
    queue, kv_share = _load(entry)
    return queue + recent.get(entry.instance_id, 0), kv_share


def pick_pair(prefills: Sequence[RegistryEntry], decodes: Sequence[RegistryEntry], num_tokens: int,
              bucket_edges: Sequence[int], request_id: str,
              recent: Mapping[str, int] | None = None, exclude_decodes: Sequence[str] = ()
              ) -> tuple[RegistryEntry, RegistryEntry]:
    """Disaggregated mode: (prefill, decode) for one request, by length bucket and load.

    Prefill: among workers serving the request's length bucket (all when none does), the lowest queue
    (running + waiting + this router's recent picks), then the lowest KV share. Decode: the same cost over
    every decode worker (decode work per token does not depend on the prompt's bucket; its KV does, which
    the KV share term covers). Decode workers without a transfer address cannot receive KV and are skipped,
    and so are `exclude_decodes` (they refused this request as full: a prefill asks again for another).
    Ties are broken by xxhash of (request id, instance id): deterministic, yet spread over equals.
    """
    recent = recent or {}
    if not prefills:
        raise LookupError("no live prefill worker in the registry")
    receivers = [d for d in decodes if d.address and d.instance_id not in exclude_decodes]
    if not receivers:
        raise LookupError("no live decode worker with a KV transfer address in the registry"
                          + (f" besides {sorted(exclude_decodes)}" if exclude_decodes else ""))
    bucket = LengthBuckets(tuple(bucket_edges)).classify(num_tokens)
    serving = [p for p in prefills if not p.buckets or bucket in p.buckets] or list(prefills)

    def key(e: RegistryEntry) -> tuple[tuple[int, float], int]:
        return _pair_cost(e, recent), xxhash.xxh64_intdigest(f"{request_id}/{e.instance_id}".encode())

    return min(serving, key=key), min(receivers, key=key)
