"""Wiring of the decode service: the disaggregated engine-worker base (libs/worker) over a DisaggEngineCore,
serving `windserve.worker.<id>.kv_prepare` and `.kv_commit`; the admitted request receives its KV and streams
tokens."""

from __future__ import annotations

from libs.bus import Unavailable
from libs.engine.disagg import DisaggEngineCore
from libs.worker.service import DisaggWorkerService
from protos import subjects
from protos.messages import KVCommitReply, KVCommitRequest, KVPrepareReply, KVPrepareRequest, Role
from services.decode import handlers
from services.decode.config import DecodeConfig


class DecodeService(DisaggWorkerService):
    role = Role.DECODE
    config: DecodeConfig
    core_class = DisaggEngineCore

    def __init__(self, config: DecodeConfig) -> None:
        super().__init__(config)
        self.worker: handlers.DecodeWorker | None = None

    async def setup_role(self) -> None:
        assert self.bus is not None and self.engine is not None
        self.worker = handlers.DecodeWorker(self.engine, self.transfer, self.config.instance_id, self.publish,
                                            transfer_timeout_s=self.config.transfer_timeout_s,
                                            admit_timeout_s=self.config.prepare_timeout_s, tasks=self.tasks,
                                            fetcher=self.fetcher, address=self._dial_address())
        await self.bus.serve(subjects.kv_prepare(self.config.namespace, self.config.instance_id), KVPrepareRequest,
                             self._prepare)
        await self.bus.serve(subjects.kv_commit(self.config.namespace, self.config.instance_id), KVCommitRequest,
                             self._commit)

    def _dial_address(self) -> str:
        """The address kv_prepare answers: the advertised one when the engine binds every interface or an
        advertise host is set (compose); else empty = the engine's own bound address, as before."""
        wildcard = self.config.transfer_host in ("0.0.0.0", "::")
        return self.address if wildcard or self.config.advertise_host else ""

    def max_prompt_tokens(self) -> int:
        # The reservation for an arriving prompt takes an SWA page per prompt page (the window slides only
        # once the KV is committed), so a prompt longer than the SWA pool (or, on one arena, than its units
        # hold of both groups' pages) can never land here.
        if self.engine is None:  # (before the engine is built: the static pools' bound)
            return self.config.engine.page_size * self.config.engine.num_swa_pages
        core = self.engine.core
        assert isinstance(core, DisaggEngineCore)
        return core.max_remote_prompt_tokens

    def role_details(self) -> dict[str, str]:
        return self.worker.stats.as_details() if self.worker is not None else {}

    async def _prepare(self, msg: KVPrepareRequest) -> KVPrepareReply:
        assert self.worker is not None
        try:
            if not self.accepting:
                raise Unavailable("decode worker is draining")
            reply = await self.worker.prepare(msg)
        except Exception:
            self.outcomes.refused += 1
            raise
        self.outcomes.accepted += 1
        return reply

    async def _commit(self, msg: KVCommitRequest) -> KVCommitReply:
        assert self.worker is not None
        return await self.worker.commit(msg)  # also while draining: it ends a hand-off already in flight
