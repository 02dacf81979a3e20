"""Wiring of the decode service: registry + health today; its request handlers come later."""

from libs.service import Service
from protos.messages import Role
from services.decode import handlers
from services.decode.config import DecodeConfig


class DecodeService(Service):
    role = Role.DECODE
    config: DecodeConfig

    def health_details(self) -> dict[str, str]:
        return handlers.health_details(self.config)
