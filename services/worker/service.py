"""Wiring of the combined worker: engine + generate handler + abort listener + load in the registry."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from libs.engine.async_engine import AsyncEngine
from libs.engine.config import EngineConfig
from libs.engine.worker import build_async_engine
from libs.service import Service
from protos import subjects
from protos.messages import (
    AbortRequest,
    GenerateAck,
    GenerateRequest,
    RegistryEntry,
    Role,
    ServiceState,
    TokenChunk,
    WorkerLoad,
)
from services.worker import metrics
from services.worker.config import WorkerConfig
from services.worker.handlers import Generations, load_from


def engine_config(cfg: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        page_size=cfg.page_size, num_full_pages=cfg.num_full_pages, num_swa_pages=cfg.num_swa_pages,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_prefix_cache=cfg.enable_prefix_cache, bucket_edges=tuple(cfg.bucket_edges),
        served_buckets=tuple(cfg.served_buckets) or None, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
    )


class WorkerService(Service):
    role = Role.WORKER
    config: WorkerConfig

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.engine: AsyncEngine | None = None
        self.generations: Generations | None = None
        self.load = WorkerLoad()

    async def setup(self) -> None:
        cfg = self.config
        assert self.bus is not None
        # Loading a real checkpoint takes a while: keep the event loop (health answers) responsive.
        engine = await asyncio.to_thread(
            build_async_engine, cfg.model or None, engine_config(cfg), output_timeout_s=cfg.output_timeout_s
        )
        engine.start()
        self.engine = engine
        vocab = int(engine.core.model_config.vocab_size)
        self.generations = Generations(engine, self._publish, cfg, vocab)
        aborts = await self.bus.subscribe(subjects.abort(cfg.namespace), AbortRequest)
        self.spawn(self._abort_loop(aborts), name="aborts", critical=True)
        await self._refresh_load()
        self.spawn(self._load_loop(), name="load", critical=True)
        await self.bus.serve(subjects.generate(cfg.namespace, cfg.instance_id), GenerateRequest, self._generate)

    async def _publish(self, subject: str, chunk: TokenChunk) -> None:
        assert self.bus is not None
        await self.bus.publish(subject, chunk)

    async def _generate(self, req: GenerateRequest) -> GenerateAck:
        assert self.generations is not None
        return self.generations.accept(req, draining=self.state != ServiceState.RUNNING)

    async def _abort_loop(self, aborts) -> None:
        assert self.generations is not None
        async for msg in aborts:
            self.generations.abort(msg.request_id)

    # --- load reporting ---------------------------------------------------------------------------

    async def _refresh_load(self) -> None:
        assert self.engine is not None
        usage, running, waiting = await self.engine.call(
            lambda core: (core.usage(), len(core.scheduler.running), core.scheduler.num_waiting), timeout_s=10.0
        )
        self.load = load_from(usage, running, waiting, time.time())
        self._export_metrics(usage)

    async def _load_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            await self._refresh_load()
            self.refresh_registration()

    def _export_metrics(self, usage) -> None:
        for pool, stats in (("full", usage.full), ("swa", usage.swa)):
            for state in ("free", "cached", "in_use", "reserved"):
                metrics.KV_PAGES.labels(pool, state).set(getattr(stats, state))
        metrics.REQUESTS.labels("running").set(self.load.running)
        metrics.REQUESTS.labels("waiting").set(self.load.waiting)
        if self.generations is not None:
            for outcome, n in dataclasses.asdict(self.generations.counters).items():
                metrics.OUTCOMES.labels(outcome).set(n)

    def registry_entry(self) -> RegistryEntry:
        base = super().registry_entry()
        return base.model_copy(update={
            "capacity": self.config.capacity or self.config.max_request_tokens,
            "buckets": list(self.config.served_buckets),
            "max_tokens": self.config.max_request_tokens,
            "load": self.load,
        })

    def health_details(self) -> dict[str, str]:
        details = {"model": self.config.model or "tiny", "serving": "yes" if self.engine else "not yet"}
        details.update({k: str(v) for k, v in self.load.model_dump(exclude={"schema_version"}).items()})
        if self.generations is not None:
            details.update({k: str(v) for k, v in dataclasses.asdict(self.generations.counters).items()})
            details["in_flight_requests"] = str(self.generations.in_flight)
        return details

    async def teardown(self) -> None:
        if self.generations is not None:
            await self.generations.drain(self.config.drain_timeout_s)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
