"""NATS bus: typed request/reply and pub/sub, large payloads, and the JetStream KV registry."""

from libs.bus.bus import Bus, BusConfig, TypedSubscription
from libs.bus.errors import BusError, BusTimeout, NoResponders, RemoteError, Unavailable
from libs.bus.registry import EventKind, HeartbeatConfig, Registration, Registry, RegistryEvent

__all__ = [
    "Bus",
    "BusConfig",
    "BusError",
    "BusTimeout",
    "EventKind",
    "HeartbeatConfig",
    "NoResponders",
    "Registration",
    "Registry",
    "RegistryEvent",
    "RemoteError",
    "TypedSubscription",
    "Unavailable",
]
