"""The router's boundary: registry entries in, the pure routing view (`libs.routing`) out."""

from __future__ import annotations

from collections.abc import Sequence

from libs.routing import Fleet, Instance, instance_of
from protos.messages import RegistryEntry, Role
from services.router.config import RouterConfig


def health_details(config: RouterConfig) -> dict[str, str]:
    """Extra health fields."""
    return {"bucket_edges": ",".join(map(str, config.bucket_edges))}


def fleet_of(entries: Sequence[RegistryEntry]) -> Fleet:
    """The live prefill, decode and combined workers of a registry listing (other roles are not routed to)."""
    def of(role: Role) -> tuple[Instance, ...]:
        return tuple(instance_of(e) for e in entries if e.role is role)
    return Fleet(prefills=of(Role.PREFILL), decodes=of(Role.DECODE), workers=of(Role.WORKER))
