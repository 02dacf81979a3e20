"""Wiring of the combined worker: the engine-worker base (libs/worker) serving `generate` itself."""

from __future__ import annotations

from libs.worker.service import EngineWorkerService
from protos.messages import Role
from services.worker.config import WorkerConfig
from services.worker.handlers import Generations


class WorkerService(EngineWorkerService):
    role = Role.WORKER
    config: WorkerConfig

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.generations: Generations | None = None

    async def setup_role(self) -> None:
        assert self.engine is not None
        self.generations = Generations(self.engine, self.publish, self.tasks, self.config.instance_id, self.fetcher)
        await self.serve_generate(self.generations.start)
