"""NATS bus: typed request/reply and pub/sub, large payloads, and the JetStream KV registry."""

from libs.bus.bus import Bus, BusConfig, TypedSubscription
from libs.bus.errors import BusError, BusTimeout, NoResponders, RemoteError, Unavailable
from libs.bus.registry import HeartbeatConfig, Registration, Registry, RegistryEvent, RegistryEventKind
from libs.bus.view import RegistryView, ViewConfig, ViewListener

__all__ = [
    "Bus",
    "BusConfig",
    "BusError",
    "BusTimeout",
    "RegistryEventKind",
    "HeartbeatConfig",
    "NoResponders",
    "Registration",
    "Registry",
    "RegistryEvent",
    "RegistryView",
    "RemoteError",
    "TypedSubscription",
    "Unavailable",
    "ViewConfig",
    "ViewListener",
]
