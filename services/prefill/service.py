"""Wiring of the prefill service: registry + health today; its request handlers come later."""

from libs.service import Service
from protos.messages import Role
from services.prefill import handlers
from services.prefill.config import PrefillConfig


class PrefillService(Service):
    role = Role.PREFILL
    config: PrefillConfig

    def health_details(self) -> dict[str, str]:
        return handlers.health_details(self.config)
