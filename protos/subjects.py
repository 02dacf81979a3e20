"""Every NATS subject windserve uses, in one place.

Subjects are dot-separated tokens; namespaces, instance ids and request ids become single tokens, so
they must not contain dots, spaces or wildcards (checked by `token()`).

Every subject and the registry bucket carry the deployment's namespace (`ns`): deployments sharing one
NATS server never answer each other's routes, aborts or probes.
"""

from __future__ import annotations

import re

PREFIX = "windserve"
DEFAULT_NAMESPACE = "default"

# Queue group names: one replica of a role answers each request.
ROUTER_QUEUE = "router"

# JetStream bucket of large payloads (keys are unique per message, so it is shared by all namespaces).
PAYLOAD_BUCKET = "windserve_payloads"

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_\-]+$")


def token(value: str) -> str:
    """Return `value` unchanged if it is a valid single subject token, else raise ValueError."""
    if not _TOKEN_RE.match(value):
        raise ValueError(f"{value!r} is not a valid subject token (allowed: letters, digits, '_' and '-')")
    return value


def _base(ns: str) -> str:
    return f"{PREFIX}.{token(ns)}"


def registry_bucket(ns: str) -> str:
    """JetStream KV bucket of the namespace's service registry."""
    return f"{PREFIX}_registry_{token(ns)}"


def route(ns: str) -> str:
    """Routing requests (request/reply; the routers of the namespace form one queue group)."""
    return f"{_base(ns)}.route"


def router_route(ns: str, instance_id: str) -> str:
    """Routing requests addressed to one router replica (request/reply, no queue group): the gateway asks a
    named router, so when one does not answer in time it asks another, not the queue group's random pick."""
    return f"{_base(ns)}.router.{token(instance_id)}.route"


def abort(ns: str) -> str:
    """Abort broadcasts: every worker of the namespace frees what it holds for the request."""
    return f"{_base(ns)}.abort"


def health(ns: str, instance_id: str) -> str:
    """Health probe of one service instance (request/reply)."""
    return f"{_base(ns)}.health.{token(instance_id)}"


def generate(ns: str, instance_id: str) -> str:
    """Generate request addressed to one worker (prefill, decode or combined worker)."""
    return f"{_base(ns)}.worker.{token(instance_id)}.generate"


def stream(ns: str, request_id: str) -> str:
    """Token chunks of one request flow from the decoding worker to the gateway on this subject."""
    return f"{_base(ns)}.stream.{token(request_id)}"


def stream_replay(ns: str, instance_id: str) -> str:
    """A worker's recent token chunks of one request, sent again (request/reply: `StreamReplayRequest`)."""
    return f"{_base(ns)}.worker.{token(instance_id)}.stream_replay"


def kv_events(ns: str, instance_id: str) -> str:
    """KV-cache events (`KVEventBatch`: stored / removed / SWA-removed block hashes) published by one worker."""
    return f"{_base(ns)}.kv_events.{token(instance_id)}"


def kv_events_all(ns: str) -> str:
    """Every worker's KV-cache events (a router's subscription; not a queue group: each replica reads all)."""
    return f"{_base(ns)}.kv_events.*"


def kv_snapshot(ns: str, instance_id: str) -> str:
    """A worker's full cached block set, consistent with an event id (request/reply, `KVSnapshotRequest`)."""
    return f"{_base(ns)}.worker.{token(instance_id)}.kv_snapshot"


def kv_hits(ns: str) -> str:
    """Actual prefix hits reported by the workers on admission (`KVHitReport`, read by every router)."""
    return f"{_base(ns)}.kv_hits"


def route_picks(ns: str) -> str:
    """Picks made by router replicas (`RoutePick`), shared so a burst does not herd onto one worker."""
    return f"{_base(ns)}.route_picks"


def kv_prepare(ns: str, instance_id: str) -> str:
    """Disaggregated mode: prefill asks one decode worker to admit a request and expect its KV, before
    computing it (request/reply, `KVPrepareRequest` -> `KVPrepareReply`)."""
    return f"{_base(ns)}.worker.{token(instance_id)}.kv_prepare"


def kv_commit(ns: str, instance_id: str) -> str:
    """Disaggregated mode: prefill tells the decode worker holding a kv_prepare reservation the first token,
    or cancels it (request/reply, `KVCommitRequest` -> `KVCommitReply`)."""
    return f"{_base(ns)}.worker.{token(instance_id)}.kv_commit"


def cache_exists(ns: str, instance_id: str) -> str:
    """GCache: which keys one storage node holds (request/reply, `CacheExistsRequest` -> `CacheExistsReply`)."""
    return f"{_base(ns)}.cache.{token(instance_id)}.exists"


def cache_get(ns: str, instance_id: str) -> str:
    """GCache: ask one storage node to send values to the client's transfer engine (`CacheGetRequest` ->
    `CacheGetReply`, then the bytes over UCX / TCP, never NATS)."""
    return f"{_base(ns)}.cache.{token(instance_id)}.get"


def cache_put(ns: str, instance_id: str) -> str:
    """GCache: announce values to one storage node (`CachePutRequest` -> `CachePutReply`, then the bytes over
    UCX / TCP to the node's transfer address)."""
    return f"{_base(ns)}.cache.{token(instance_id)}.put"


def encoder_encode(ns: str, instance_id: str) -> str:
    """Encoder: embed one image / video and keep it (request/reply, `EncodeRequest` -> `EncodeReply`)."""
    return f"{_base(ns)}.encoder.{token(instance_id)}.encode"


def encoder_fetch(ns: str, instance_id: str) -> str:
    """Encoder: send cached embeddings to a worker's transfer engine (`EmbedFetchRequest` -> `EmbedFetchReply`,
    then the rows over UCX / TCP)."""
    return f"{_base(ns)}.encoder.{token(instance_id)}.fetch"
