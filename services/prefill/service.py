"""Wiring of the prefill service (and the shared base of the decode service).

`EngineRoleService`: model + engine (on its own thread), a KV transfer engine whose address goes into
the registry entry, the abort listener, and the load snapshot refreshed into the registry every
`load_interval_s` (read by the router). `PrefillService` serves `windserve.worker.<id>.generate`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any, ClassVar

from libs.engine import AsyncEngine
from libs.engine.core import EngineCore
from libs.service import Service
from libs.transfer import create_engine, parse_address
from protos import subjects
from protos.messages import (
    AbortRequest,
    AckStatus,
    GenerateAck,
    GenerateRequest,
    KVCommitReply,
    KVCommitRequest,
    KVPrepareReply,
    KVPrepareRequest,
    RegistryEntry,
    Role,
    RouteReply,
    RouteRequest,
    ServiceState,
    TokenChunk,
    WorkerLoad,
)
from services.prefill import handlers
from services.prefill.config import EngineServiceConfig, PrefillConfig


def advertised_address(bound: str, config: EngineServiceConfig) -> str:
    """The transfer address peers dial: the bound one, with the advertised host when binding all interfaces
    (this host's IP: under compose every replica has the same service name but its own IP)."""
    scheme, host, port = parse_address(bound)
    if config.advertise_host:
        host = config.advertise_host
    elif host in ("0.0.0.0", "::"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{scheme}://{host}:{port}"


class EngineRoleService(Service):
    """Base of the prefill and decode services."""

    config: EngineServiceConfig
    core_class: ClassVar[type[EngineCore]] = EngineCore

    def __init__(self, config: EngineServiceConfig) -> None:
        super().__init__(config)
        self.engine: AsyncEngine | None = None
        self.transfer: Any = None  # a started libs.transfer engine (UCX or the TCP fallback)
        self.address = ""
        self.load = WorkerLoad()
        # The role's handler object (PrefillWorker / DecodeWorker): abort(id), stats, tasks.
        self.worker: Any = None

    async def setup(self) -> None:
        assert self.bus is not None
        # Loading a real checkpoint takes a while: keep the event loop (health answers) responsive.
        engine: AsyncEngine = await asyncio.to_thread(self._build_engine)
        engine.start()
        self.engine = engine
        self.transfer = create_engine()
        self.address = advertised_address(await self.transfer.start(host=self.config.transfer_host), self.config)
        await self.setup_role()
        aborts = await self.bus.subscribe(subjects.abort(self.config.namespace), AbortRequest)
        self.spawn(self._abort_loop(aborts), name="aborts", critical=True)
        await self._refresh_load()
        self.spawn(self._load_loop(), name="load", critical=True)

    def _build_engine(self) -> AsyncEngine:
        from libs.model import load_model, load_tokenizer

        cfg = self.config.engine_config()
        model, model_config = load_model(self.config.model or None, dtype=cfg.torch_dtype, device=cfg.device)
        core = self.core_class(cfg, model, model_config, load_tokenizer(self.config.model or None))
        return AsyncEngine(core, output_timeout_s=self.config.output_timeout_s)

    async def setup_role(self) -> None:
        """Serve the role's subjects (engine and transfer engine are running)."""

    async def abort_request(self, request_id: str) -> None:
        """Free everything held for request_id (broadcast abort)."""
        if self.worker is not None:
            await self.worker.abort(request_id)

    async def publish(self, subject: str, chunk: TokenChunk) -> None:
        assert self.bus is not None
        await self.bus.publish(subject, chunk)

    async def _abort_loop(self, aborts) -> None:
        async for msg in aborts:
            await self.abort_request(msg.request_id)

    async def _refresh_load(self) -> None:
        assert self.engine is not None
        usage, running, waiting = await self.engine.call(
            lambda core: (core.usage(), len(core.scheduler.running) + len(getattr(core, "pending", ())),
                          core.scheduler.num_waiting), timeout_s=10.0)
        self.load = WorkerLoad(running=running, waiting=waiting, kv_full_used=usage.full.in_use,
                               kv_full_total=usage.full.capacity, kv_swa_used=usage.swa.in_use,
                               kv_swa_total=usage.swa.capacity, updated_at=time.time())

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            await self._refresh_load()
            self.refresh_registration()

    def registry_entry(self) -> RegistryEntry:
        base = super().registry_entry()
        return base.model_copy(update={
            "address": self.address,
            "capacity": self.config.capacity or self.config.page_size * self.config.num_full_pages,
            "buckets": list(self.config.served_buckets),
            "max_tokens": self.config.page_size * self.config.num_full_pages,
            "load": self.load,
        })

    def role_details(self) -> dict[str, str]:
        if self.worker is None:
            return {}
        return {**self.worker.stats.as_details(), "in_flight_requests": str(len(self.worker.tasks))}

    def health_details(self) -> dict[str, str]:
        details = {"model": self.config.model or "tiny", "address": self.address,
                   "serving": "yes" if self.engine else "not yet"}
        details.update({k: str(v) for k, v in self.load.model_dump(exclude={"schema_version"}).items()})
        details.update(self.role_details())
        return details

    async def teardown_role(self) -> None:
        """Let in-flight requests finish (bounded)."""
        if self.worker is not None and self.worker.tasks:
            await asyncio.wait(set(self.worker.tasks.values()), timeout=self.config.drain_timeout_s)

    async def teardown(self) -> None:
        await self.teardown_role()
        if self.transfer is not None:
            await self.transfer.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)


class PrefillService(EngineRoleService):
    role = Role.PREFILL
    config: PrefillConfig

    def __init__(self, config: PrefillConfig) -> None:
        super().__init__(config)
        self.worker: handlers.PrefillWorker | None = None

    async def setup_role(self) -> None:
        assert self.bus is not None and self.engine is not None
        cfg = self.config
        self.worker = handlers.PrefillWorker(
            self.engine, self.transfer, cfg.instance_id, self._prepare, self.publish, commit=self._commit,
            prepare_timeout_s=cfg.prepare_timeout_s, transfer_timeout_s=cfg.transfer_timeout_s,
            reroute=self._reroute, decode_attempts=cfg.decode_attempts, segment_pages=cfg.kv_segment_pages)
        await self.bus.serve(subjects.generate(cfg.namespace, cfg.instance_id), GenerateRequest, self._generate)

    async def _prepare(self, decode_instance: str, msg: KVPrepareRequest) -> KVPrepareReply:
        assert self.bus is not None
        return await self.bus.request(subjects.kv_prepare(self.config.namespace, decode_instance), msg, KVPrepareReply,
                                      timeout=self.config.prepare_timeout_s)

    async def _commit(self, decode_instance: str, msg: KVCommitRequest) -> KVCommitReply:
        assert self.bus is not None
        return await self.bus.request(subjects.kv_commit(self.config.namespace, decode_instance), msg, KVCommitReply,
                                      timeout=self.config.prepare_timeout_s)

    async def _reroute(self, request_id: str, num_tokens: int, refused: list[str]) -> str:
        """Ask the router for another decode worker than those that refused the request."""
        assert self.bus is not None
        reply = await self.bus.request(subjects.route(self.config.namespace),
                                       RouteRequest(request_id=request_id, num_tokens=num_tokens,
                                                    exclude_decodes=refused),
                                       RouteReply, timeout=self.config.prepare_timeout_s)
        if reply.decode_instance in refused or not reply.decode_instance:
            raise LookupError(f"the router offered no decode worker besides {refused}")
        return reply.decode_instance

    async def _generate(self, req: GenerateRequest) -> GenerateAck:
        assert self.worker is not None and self.engine is not None
        refusal = handlers.refusal(req, self.engine.core.model_config.vocab_size,
                                   self.config.page_size * self.config.num_full_pages)
        if self.state is not ServiceState.RUNNING and self.state is not ServiceState.STARTING:
            refusal = (AckStatus.BUSY, "prefill worker is draining")
        if refusal is None and req.request_id in self.worker.tasks:
            refusal = (AckStatus.INVALID, f"request id {req.request_id!r} is already running")
        if refusal is not None:
            return GenerateAck(request_id=req.request_id, instance_id=self.config.instance_id,
                               status=refusal[0], message=refusal[1])
        self.worker.submit(req)
        return GenerateAck(request_id=req.request_id, instance_id=self.config.instance_id)
