"""Wiring of the router service: answers `windserve.route` (queue group `router`) from the registry.

Disaggregated mode (prefill and decode workers live): a (prefill, decode) pair by length bucket and load.
Aggregated mode (only combined workers): the least-loaded worker prefills and decodes.
"""

import time

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
        self.recent = handlers.RecentPicks()

    async def setup(self) -> None:
        assert self.bus is not None
        await self.bus.serve(subjects.route(self.config.namespace), RouteRequest, self._route,
                             queue=subjects.ROUTER_QUEUE)

    async def _route(self, req: RouteRequest) -> RouteReply:
        assert self.registry is not None
        entries = await self.registry.list(timeout=self.config.registry_timeout_s)
        by_role = {role: [e for e in entries if e.role is role] for role in (Role.PREFILL, Role.DECODE, Role.WORKER)}
        if by_role[Role.PREFILL] and by_role[Role.DECODE]:
            now = time.time()  # the workers stamp their load snapshots with unix time
            reflected = {e.instance_id: e.load.updated_at for e in entries if e.load is not None}
            prefill, decode = handlers.pick_pair(by_role[Role.PREFILL], by_role[Role.DECODE], req.num_tokens,
                                                 self.config.bucket_edges, req.request_id,
                                                 self.recent.counts(now, reflected), req.exclude_decodes)
            if not req.exclude_decodes:  # (a prefill asking again for a decode worker: its own pick stands)
                self.recent.add(prefill.instance_id, now)
            self.recent.add(decode.instance_id, now)
            return RouteReply(prefill_instance=prefill.instance_id, decode_instance=decode.instance_id)
        if not by_role[Role.WORKER] and (by_role[Role.PREFILL] or by_role[Role.DECODE]):
            raise LookupError(f"disaggregated mode needs prefill and decode workers; live: "
                              f"{len(by_role[Role.PREFILL])} prefill, {len(by_role[Role.DECODE])} decode")
        worker = handlers.pick_worker(by_role[Role.WORKER], req.num_tokens, self.config.bucket_edges, req.request_id)
        # Aggregated: the same instance prefills and decodes.
        return RouteReply(prefill_instance=worker.instance_id, decode_instance=worker.instance_id)

    def health_details(self) -> dict[str, str]:
        return handlers.health_details(self.config)
