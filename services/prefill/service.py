"""Wiring of the prefill service: the disaggregated engine-worker base (libs/worker) serving
`windserve.worker.<id>.generate`, asking decode workers (kv_prepare) and the router (reroutes) over the bus."""

from __future__ import annotations

from libs.worker.service import DisaggWorkerService
from protos import subjects
from protos.messages import (
    AckStatus,
    GenerateRequest,
    KVCommitReply,
    KVCommitRequest,
    KVPrepareReply,
    KVPrepareRequest,
    Role,
    RouteReply,
    RouteRequest,
)
from services.prefill import handlers
from services.prefill.config import PrefillConfig


class PrefillService(DisaggWorkerService):
    role = Role.PREFILL
    config: PrefillConfig

    def __init__(self, config: PrefillConfig) -> None:
        super().__init__(config)
        self.worker: handlers.PrefillWorker | None = None

    async def setup_role(self) -> None:
        assert self.engine is not None
        cfg = self.config
        self.worker = handlers.PrefillWorker(
            self.engine, self.transfer, cfg.instance_id, self._prepare, self.publish, commit=self._commit,
            prepare_timeout_s=cfg.prepare_timeout_s, transfer_timeout_s=cfg.transfer_timeout_s,
            reroute=self._reroute, decode_attempts=cfg.decode_attempts, segment_pages=cfg.kv_segment_pages,
            tasks=self.tasks, decode_wait_s=cfg.decode_wait_s, decode_wait_queue=cfg.decode_wait_queue,
            fetcher=self.fetcher, unreachable_grace_s=cfg.decode_unreachable_grace_s)
        await self.serve_generate(self.worker.submit)

    def role_refusal(self, req: GenerateRequest) -> tuple[AckStatus, str] | None:
        return handlers.refusal(req)

    def role_details(self) -> dict[str, str]:
        return self.worker.stats.as_details() if self.worker is not None else {}

    def role_outcomes(self) -> dict[str, int]:
        # a request handed off is finished by the decode worker; here it ends with the transfer
        return {"handed_off": self.worker.stats.requests if self.worker is not None else 0}

    async def _prepare(self, decode_instance: str, msg: KVPrepareRequest) -> KVPrepareReply:
        assert self.bus is not None
        return await self.bus.request(subjects.kv_prepare(self.config.namespace, decode_instance), msg, KVPrepareReply,
                                      timeout=self.config.prepare_timeout_s)

    async def _commit(self, decode_instance: str, msg: KVCommitRequest) -> KVCommitReply:
        assert self.bus is not None
        return await self.bus.request(subjects.kv_commit(self.config.namespace, decode_instance), msg, KVCommitReply,
                                      timeout=self.config.prepare_timeout_s)

    async def _reroute(self, request_id: str, token_ids: list[int], refused: list[str]) -> str:
        """Ask the router for another decode worker than those that refused the request. The prompt's chain
        goes with it, so the router predicts each decode worker's hit for it as on the first ask."""
        assert self.bus is not None
        reply = await self.bus.request(subjects.route(self.config.namespace),
                                       RouteRequest(request_id=request_id, num_tokens=len(token_ids),
                                                    block_hashes=self.prompt_chain(token_ids),
                                                    exclude_decodes=refused),
                                       RouteReply, timeout=self.config.prepare_timeout_s)
        if reply.decode_instance in refused or not reply.decode_instance:
            raise LookupError(f"the router offered no decode worker besides {refused}")
        return reply.decode_instance
