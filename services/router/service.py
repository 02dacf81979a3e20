"""Wiring of the router service: answers `windserve.route` (queue group `router`) from the registry.

The choice itself is pure and lives in `libs.routing` (docs/routing.md): disaggregated mode (prefill and
decode workers live) answers a (prefill, decode) pair by length bucket and load; aggregated mode (only
combined workers) answers the least-loaded worker for both.
"""

import time

from libs.routing import Router
from libs.service import Service
from protos import subjects
from protos.messages import Role, RouteReply, RouteRequest
from services.router import handlers
from services.router.config import RouterConfig


class RouterService(Service):
    role = Role.ROUTER
    config: RouterConfig

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.router = Router(config.bucket_edges)

    async def setup(self) -> None:
        assert self.bus is not None
        await self.bus.serve(subjects.route(self.config.namespace), RouteRequest, self._route,
                             queue=subjects.ROUTER_QUEUE)

    async def _route(self, req: RouteRequest) -> RouteReply:
        assert self.registry is not None
        entries = await self.registry.list(timeout=self.config.registry_timeout_s)
        route = self.router.route(handlers.fleet_of(entries), req.request_id, req.num_tokens,
                                  now=time.time(),  # the workers stamp their load snapshots with unix time
                                  exclude_decodes=req.exclude_decodes)
        return RouteReply(prefill_instance=route.prefill, decode_instance=route.decode)

    def health_details(self) -> dict[str, str]:
        return handlers.health_details(self.config)
