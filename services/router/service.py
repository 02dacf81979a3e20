"""Wiring of the router service: answers `windserve.route` (queue group `router`) from the registry."""

from libs.service import Service
from protos import subjects
from protos.messages import Role, RouteReply, RouteRequest
from services.router import handlers
from services.router.config import RouterConfig


class RouterService(Service):
    role = Role.ROUTER
    config: RouterConfig

    async def setup(self) -> None:
        assert self.bus is not None
        await self.bus.serve(subjects.ROUTE, RouteRequest, self._route, queue=subjects.ROUTER_QUEUE)

    async def _route(self, req: RouteRequest) -> RouteReply:
        assert self.registry is not None
        workers = await self.registry.list(Role.WORKER, timeout=self.config.registry_timeout_s)
        worker = handlers.pick_worker(workers, req.num_tokens, self.config.bucket_edges, req.request_id)
        # Aggregated: the same instance prefills and decodes.
        return RouteReply(prefill_instance=worker.instance_id, decode_instance=worker.instance_id)

    def health_details(self) -> dict[str, str]:
        return handlers.health_details(self.config)
