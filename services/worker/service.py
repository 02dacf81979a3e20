"""Wiring of the worker service: registry + health today; its request handlers come later."""

from libs.service import Service
from protos.messages import Role
from services.worker import handlers
from services.worker.config import WorkerConfig


class WorkerService(Service):
    role = Role.WORKER
    config: WorkerConfig

    def health_details(self) -> dict[str, str]:
        return handlers.health_details(self.config)
