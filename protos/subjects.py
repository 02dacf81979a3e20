"""Every NATS subject windserve uses, in one place.

Subjects are dot-separated tokens; instance ids and request ids become single tokens, so they
must not contain dots, spaces or wildcards (checked by `token()`).
"""

from __future__ import annotations

import re

PREFIX = "windserve"

# Fixed subjects (many responders in a queue group, or broadcast).
ROUTE = f"{PREFIX}.route"
ABORT = f"{PREFIX}.abort"
KV_EVENTS_ALL = f"{PREFIX}.kv_events.*"

# Queue group names: one replica of a role answers each request.
ROUTER_QUEUE = "router"

# JetStream buckets.
REGISTRY_BUCKET = "windserve_registry"
PAYLOAD_BUCKET = "windserve_payloads"

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_\-]+$")


def token(value: str) -> str:
    """Return `value` unchanged if it is a valid single subject token, else raise ValueError."""
    if not _TOKEN_RE.match(value):
        raise ValueError(f"{value!r} is not a valid subject token (allowed: letters, digits, '_' and '-')")
    return value


def health(instance_id: str) -> str:
    """Health probe of one service instance (request/reply)."""
    return f"{PREFIX}.health.{token(instance_id)}"


def generate(instance_id: str) -> str:
    """Generate request addressed to one worker (prefill, decode or combined worker)."""
    return f"{PREFIX}.worker.{token(instance_id)}.generate"


def stream(request_id: str) -> str:
    """Token chunks of one request flow from the decoding worker to the gateway on this subject."""
    return f"{PREFIX}.stream.{token(request_id)}"


def kv_events(instance_id: str) -> str:
    """KV-cache events (stored / removed block hashes) published by one worker."""
    return f"{PREFIX}.kv_events.{token(instance_id)}"


def kv_prepare(instance_id: str) -> str:
    """Disaggregated mode: prefill asks one decode worker to admit a request and expect its KV
    (request/reply, `KVPrepareRequest` -> `KVPrepareReply`)."""
    return f"{PREFIX}.worker.{token(instance_id)}.kv_prepare"
